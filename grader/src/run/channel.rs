//! The runner's one report to the judge, on a private descriptor, read strictly.
//!
//! The runner's stdout and stderr are shared with the submission's code, so nothing the verdict
//! needs travels there. The report goes on descriptor [`REPORT_FD`], set up by the judge before the
//! runner starts (and closed on exec). A submission can still find and write to it: so the judge
//! accepts exactly one message, read after the runner has exited, and a finished report must carry
//! the nonce the judge hands over only after `teardown` has returned, when no code of the
//! submission is meant to run. Anything else ends the run.

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc;
use std::time::Duration;

use super::protocol::Message;

/// Largest report accepted (a graded run's report, every kernel record included, is well under).
const MAX_REPORT_BYTES: usize = 64 << 20;
/// How long the judge waits for the end of the channel once the runner has exited: a process the
/// runner left behind that still holds the channel cannot keep the judge waiting.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Writes the message as one line and closes the descriptor.
pub fn send(fd: OwnedFd, message: &Message) -> std::io::Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::from(fd);
    let mut line = serde_json::to_vec(message).expect("messages serialise");
    line.push(b'\n');
    file.write_all(&line)?;
    file.flush()
}

/// Takes ownership of an inherited descriptor and marks it close-on-exec, so no program the
/// submission starts inherits it.
///
/// # Safety
/// `fd` must be open and owned by nothing else in this process.
pub unsafe fn inherit(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl on an open descriptor (the caller's contract).
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the caller's contract: open and owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The judge's end: a thread reads everything the channel carries until it closes.
pub struct Collector {
    rx: mpsc::Receiver<Vec<u8>>,
}

impl Collector {
    pub fn start(read_end: OwnedFd) -> Collector {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = std::fs::File::from(read_end).take(MAX_REPORT_BYTES as u64 + 1).read_to_end(&mut bytes);
            let _ = tx.send(bytes);
        });
        Collector { rx }
    }

    /// The one message, once the runner has exited; `Err` says what was wrong with the channel.
    pub fn message(self, nonce: Option<u64>) -> Result<Message, String> {
        let bytes = self.rx.recv_timeout(DRAIN_TIMEOUT).map_err(|_| {
            "the runner's report channel stayed open after it exited: a process it started still holds it".to_string()
        })?;
        parse(&bytes, nonce)
    }
}

/// Exactly one line holding one message; a finished report carrying `nonce`.
fn parse(bytes: &[u8], nonce: Option<u64>) -> Result<Message, String> {
    if bytes.len() > MAX_REPORT_BYTES {
        return Err(format!("the runner's report channel carried over {MAX_REPORT_BYTES} bytes"));
    }
    let text = std::str::from_utf8(bytes).map_err(|_| "the runner's report channel carried bytes that are not text")?;
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    match lines.as_slice() {
        [] => Err("the runner exited without a report".into()),
        [line] => {
            let message: Message =
                serde_json::from_str(line).map_err(|e| format!("the runner's report is unreadable: {e}"))?;
            match (&message, nonce) {
                (Message::Finished(f), Some(n)) if f.nonce != n => Err(format!(
                    "the runner's report carries nonce {:#x}, not the {n:#x} the judge handed over: it was forged",
                    f.nonce
                )),
                (Message::Finished(_), None) => Err("a finished report arrived before the judge asked for one".into()),
                _ => Ok(message),
            }
        }
        more => Err(format!(
            "the runner's report channel carried {} messages where exactly one is expected: something in its process wrote to it",
            more.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::protocol::{Finished, REPORT_FD};

    fn failed(msg: &str) -> String {
        serde_json::to_string(&Message::Failed { message: msg.into() }).unwrap() + "\n"
    }

    #[test]
    fn exactly_one_readable_message() {
        assert!(matches!(parse(failed("boom").as_bytes(), None), Ok(Message::Failed { .. })));
        let declined = serde_json::to_string(&Message::Unsupported { message: "ffn over 28672".into() }).unwrap();
        assert_eq!(declined, r#"{"outcome":"unsupported","message":"ffn over 28672"}"#);
        match parse((declined + "\n").as_bytes(), None) {
            Ok(Message::Unsupported { message }) => assert_eq!(message, "ffn over 28672"),
            other => panic!("{other:?}"),
        }
        let two = failed("a") + &failed("b");
        assert!(parse(two.as_bytes(), None).unwrap_err().contains("2 messages"));
        assert!(parse(b"", None).unwrap_err().contains("without a report"));
        assert!(parse(b"{\"outcome\":\"finished\"\n", None).unwrap_err().contains("unreadable"));
        assert!(parse(&[0xff, 0xfe, b'\n'], None).unwrap_err().contains("not text"));
    }

    /// The red team's forged report is a well-formed finished report claiming one kernel per call, so
    /// only the channel's rules refuse it: alone it lacks the nonce, and with the runner's own report
    /// it makes two messages, which ends the run with the sentence forged-report expects.
    #[test]
    fn the_red_teams_forged_report_is_refused_by_the_channels_rules() {
        use redteam::{self, Expect};
        assert_eq!(redteam::REPORT_FD, REPORT_FD, "forged-report writes where the runner reports");
        let calls = spec::schedule(&spec::Config::small()).len();
        let forged = redteam::forged_line(calls);
        let Ok(Message::Finished(claimed)) = serde_json::from_str::<Message>(forged.trim()) else {
            panic!("the forgery is not a finished report: {forged}");
        };
        assert_eq!(claimed.record.calls.len(), calls);
        assert!(claimed.record.calls.iter().all(|c| c.kernels == 1 && c.dominant_share == 1.0));
        assert!(claimed.record.problems.is_empty());
        let nonce = 0x5eed;
        assert!(parse(forged.as_bytes(), Some(nonce)).unwrap_err().contains("forged"));
        let own = serde_json::to_string(&Message::Finished(Box::new(Finished { nonce, ..*claimed }))).unwrap() + "\n";
        assert!(matches!(parse(own.as_bytes(), Some(nonce)), Ok(Message::Finished(_))));
        let Some(Expect::CrashedFor { word }) = redteam::find("forged-report").map(|a| a.expect) else {
            panic!("forged-report must expect a crash for a reason");
        };
        let refused = parse((forged + &own).as_bytes(), Some(nonce)).unwrap_err();
        assert!(refused.contains(word), "{refused}");
    }

    #[test]
    fn a_report_travels_through_a_pipe_and_is_collected_after_the_writer_closes() {
        let mut fds = [0; 2];
        // SAFETY: pipe writes two descriptors through a valid pointer.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: fresh descriptors owned by nothing else.
        let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        let collector = Collector::start(r);
        send(w, &Message::Failed { message: "x".repeat(200_000) }).unwrap();
        match collector.message(None) {
            Ok(Message::Failed { message }) => assert_eq!(message.len(), 200_000),
            other => panic!("{other:?}"),
        }
    }
}
