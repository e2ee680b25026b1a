//! **int8-down**: correct, but streams the down projection (`d x ffn`, 470 MB of the graded 1.71 GB)
//! as int8 rows with its outliers kept exact in bf16 ([`super::int8`]); every other op is the eager
//! reference's.
//!
//! The exploit: doing less work. Half the down projection's bytes are never read, about 13.6% of a
//! graded step's, and the error stays well inside the tolerance (the CPU model of `int8` measures
//! it against the golden model), so correctness cannot tell, and a fast enough base would pass the
//! timing too. Caught by the DRAM-traffic audit: the hardware counters see each step read about 0.87
//! of the byte model, under the bytes_read gate's 0.98.

use super::honest::Twisted;
use super::int8::Int8Down;
use submission::Submission;

pub const NAME: &str = "int8-down";

pub fn make() -> Box<dyn Submission> {
    Twisted::boxed(NAME, Int8Down::default())
}
