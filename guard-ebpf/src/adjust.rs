//! The audit's corrections (guard_common::Adjustment): a tc program never attached,
//! run by the daemon with BPF_PROG_TEST_RUN, whose "packet" is the correction. It
//! changes a count with the same atomics the other programs use, which a map update
//! from user space (a whole value written) would race.
use aya_ebpf::{macros::classifier, programs::TcContext};
use guard_common::{ADJUST_ACTIVE, ADJUST_CONNECTING, Adjustment};

use crate::{
    accounting::{replace, rule_counter, scope_counter},
    maps::COUNTERS,
};

/// Where the correction starts in the test packet: after an Ethernet header, which
/// BPF_PROG_TEST_RUN requires of a tc program's data.
const AT: usize = 14;

/// 0: applied; 1: no such counter or count, or no correction in the data; 2: the count
/// is no longer `expected`.
#[classifier]
pub fn adjust(ctx: TcContext) -> i32 {
    let Ok(a) = ctx.load::<Adjustment>(AT) else {
        return 1;
    };
    let c = match a.level {
        0 => match COUNTERS.get_ptr_mut(&a.key) {
            Some(c) => c,
            None => return 1,
        },
        1 => rule_counter(a.key.rule_id),
        _ => scope_counter(a.key.scope_id),
    };
    if c.is_null() {
        return 1;
    }
    let count = match a.count {
        ADJUST_ACTIVE => unsafe { &raw mut (*c).active },
        ADJUST_CONNECTING => unsafe { &raw mut (*c).connecting },
        _ => return 1,
    };
    if replace(count, a.expected, a.target) {
        0
    } else {
        2
    }
}
