//! The probes' analysis on data whose answer is known: `probes/stall-samples --csv` reads a dump of
//! per-PC metrics as the probe writes it on a GPU machine (no GPU here), so a change to its reading
//! fails here rather than on the next measurement.

use std::path::Path;
use std::process::{Command, Output};

/// A dump of a 1 ms launch of 2 blocks of 64 threads (4 warps): 400 samples, so 0.1 a warp-us. Two
/// regions of code 4 KB apart (the probe joins instructions at most 256 bytes apart), and PC 0x0, an
/// instance of a launch metric that is not code.
const DUMP: &str = "\
pc,sass,inst_executed,smsp__pcsamp_sample_count,smsp__pcsamp_warps_issue_stalled_no_instructions,\
smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_barrier_not_issued,\
gpu__time_duration.sum,launch__grid_size,launch__block_size
launch,,0,0,0,0,0,1000000,2,64
0x0,,99,0,0,0,0,0,0,0
0x7f0000000000,BAR.SYNC.DEFER_BLOCKING 0x0,10,100,20,50,7,0,0,0
0x7f0000000010,\"HMMA.16816.F32.BF16 R0, R4, R8, R0\",10,100,0,0,0,0,0,0
0x7f0000000020,NOP,0,0,0,0,0,0,0,0
0x7f0000001000,\"MUFU.EX2 R1, R2\",5,200,100,0,0,0,0,0
";

/// `probes/stall-samples --csv` on `text` written as a dump of its own (removed after).
fn probe(name: &str, text: &str, min_share: &str) -> Output {
    let dir = std::env::temp_dir().join(format!("stall-samples-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let csv = dir.join("pcs.csv");
    std::fs::write(&csv, text).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("probes/stall-samples");
    let out =
        Command::new("bash").arg(script).arg("--csv").arg(&csv).arg(min_share).output().expect("bash runs the probe");
    std::fs::remove_dir_all(&dir).unwrap();
    out
}

#[test]
fn stall_samples_reads_regions_shares_and_warp_time() {
    let out = probe("known", DUMP, "0");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("launch: 1.000 ms, 2 blocks of 64 threads; 400 samples, 0.1000 a warp-us"), "{text}");
    // Warp-us: samples over 0.1 a warp-us, the not-issued counts left out; the opcodes of note executed.
    let lines: Vec<&str> = text.lines().filter(|l| l.contains('%')).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(lines[0].trim_start().starts_with("0-    10") && lines[0].contains("50.00%"), "{text}");
    assert!(lines[0].ends_with("no_instructions 200, barrier 500; BAR HMMA"), "{text}");
    assert!(lines[1].trim_start().starts_with("1000-  1000") && lines[1].contains("50.00%"), "{text}");
    assert!(lines[1].ends_with("no_instructions 1000; MUFU.EX2"), "{text}");
    // A share under MIN_SHARE is left out: each region holds 50%.
    let out = probe("share", DUMP, "60");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("region") && !text.contains("50.00%"), "{text}");
}

#[test]
fn stall_samples_refuses_a_dump_without_samples() {
    let empty = DUMP
        .lines()
        .map(|l| if l.starts_with("0x7f") { l.replace(",100,", ",0,").replace(",200,", ",0,") } else { l.to_string() });
    let out = probe("empty", &empty.collect::<Vec<_>>().join("\n"), "0.5");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the report holds no PC samples"));
}
