//! The honest ensemble (`crate::ensemble`) over [`SEEDS`] weight seeds at three sizes; the graded
//! size gets one call per seed (a graded step costs a variant 3 to 5 core-seconds), the others more.

use reference::golden::ensemble::SEEDS;
use spec::Config;

use super::{Check, CheckResult, Ctx, Failure};

pub fn checks() -> Vec<Check> {
    vec![
        Check { name: "honest ensemble (tiny)", run: |c| ensemble(c, Config::tiny()) },
        Check { name: "honest ensemble (small)", run: |c| ensemble(c, Config::small()) },
        Check { name: "honest ensemble (graded)", run: |c| ensemble(c, Config::graded()) },
    ]
}

fn ensemble(ctx: &mut Ctx, cfg: Config) -> CheckResult {
    let m = crate::ensemble::margins(&ctx.dev, &cfg, ctx.seed..ctx.seed + SEEDS)?;
    match m.failure() {
        Some(why) => Err(Failure(why)),
        None => Ok(m.shown()),
    }
}
