//! The fair split of a fleet budget: weighted max-min fairness over what each host
//! wants, after each host's floor.
//!
//! Floors come first (a host keeps its floor whatever it wants, so that its first
//! connections need not wait for a sync); when the floors alone exceed the total they
//! are themselves split max-min. What is left is water-filled: every host gets what it
//! still wants up to a level proportional to its weight, and what the hosts that want
//! less leave goes to the hosts that want more. Capacity nobody wants stays unassigned,
//! so that a demand jump is served from it by one transaction, without waiting for
//! other hosts to lower. Shares are whole connections: the units that the level's
//! fractions leave are given one each, largest fraction first, then in the order of
//! the claimants (the caller orders them by identity, so every host computes the same
//! split from the same records).
use std::cmp::Ordering;

/// One host's part in the split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claimant {
    /// Connections it wants.
    pub wants: u64,
    /// Its weight (at least 1): at equal want, shares are proportional to weights.
    pub weight: u32,
    /// Connections it keeps whatever it wants, while the floors fit in the total.
    pub floor: u64,
}

/// Each claimant's target share of `total`, in the claimants' order. The shares add up
/// to at most `total`, and to exactly `min(total, Σ max(wants, floor))`.
pub fn fair_shares(total: u64, claimants: &[Claimant]) -> Vec<u64> {
    let weights: Vec<u64> = claimants
        .iter()
        .map(|c| u64::from(c.weight.max(1)))
        .collect();
    let floors: Vec<u64> = claimants.iter().map(|c| c.floor).collect();
    let mut shares = water_fill(total, &floors, &weights);
    let rest = total - shares.iter().sum::<u64>();
    let needs: Vec<u64> = claimants
        .iter()
        .zip(&shares)
        .map(|(c, s)| c.wants.saturating_sub(*s))
        .collect();
    for (s, more) in shares.iter_mut().zip(water_fill(rest, &needs, &weights)) {
        *s += more;
    }
    shares
}

/// Splits `capacity` so that each index gets at most `needs[i]`, and those that get
/// less than they need all sit at one level proportional to their weight (give or take
/// the one unit that rounding hands out).
fn water_fill(capacity: u64, needs: &[u64], weights: &[u64]) -> Vec<u64> {
    let mut out = vec![0u64; needs.len()];
    if needs.iter().sum::<u64>() <= capacity {
        out.copy_from_slice(needs);
        return out;
    }
    // Ascending by need per unit of weight: the hosts that want least are filled first.
    let mut order: Vec<usize> = (0..needs.len()).collect();
    order.sort_by(|&a, &b| ratio_cmp(needs[a], weights[a], needs[b], weights[b]).then(a.cmp(&b)));
    let (mut left, mut weight) = (capacity, weights.iter().sum::<u64>());
    let mut at = 0;
    // Satisfied while need / weight <= left / weight_left.
    while at < order.len() {
        let i = order[at];
        if u128::from(needs[i]) * u128::from(weight) > u128::from(left) * u128::from(weights[i]) {
            break;
        }
        out[i] = needs[i];
        left -= needs[i];
        weight -= weights[i];
        at += 1;
    }
    // The others share what is left by weight; each one's need is above its part.
    let rest = &order[at..];
    let mut fractions = Vec::with_capacity(rest.len());
    let mut given = 0;
    for &i in rest {
        let exact = u128::from(left) * u128::from(weights[i]);
        out[i] = (exact / u128::from(weight)) as u64;
        given += out[i];
        fractions.push((exact % u128::from(weight), i));
    }
    fractions.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    for (_, i) in fractions.into_iter().take((left - given) as usize) {
        out[i] += 1;
    }
    out
}

/// Compares a/wa with b/wb without division.
fn ratio_cmp(a: u64, wa: u64, b: u64, wb: u64) -> Ordering {
    (u128::from(a) * u128::from(wb)).cmp(&(u128::from(b) * u128::from(wa)))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn wanting(wants: &[u64]) -> Vec<Claimant> {
        wants
            .iter()
            .map(|&wants| Claimant {
                wants,
                weight: 1,
                floor: 0,
            })
            .collect()
    }

    #[test]
    fn equal_demand_splits_equally() {
        assert_eq!(fair_shares(60, &wanting(&[55, 55, 55])), [20, 20, 20]);
        assert_eq!(fair_shares(60, &wanting(&[55, 0, 55])), [30, 0, 30]);
    }

    #[test]
    fn who_wants_less_gets_it_and_the_rest_goes_to_who_wants_more() {
        assert_eq!(fair_shares(60, &wanting(&[5, 50, 50])), [5, 28, 27]);
        assert_eq!(fair_shares(100, &wanting(&[10, 30, 200])), [10, 30, 60]);
    }

    #[test]
    fn capacity_nobody_wants_stays_unassigned() {
        assert_eq!(fair_shares(60, &wanting(&[5, 10, 0])), [5, 10, 0]);
    }

    #[test]
    fn the_rounding_units_go_by_largest_fraction_then_order() {
        assert_eq!(fair_shares(10, &wanting(&[9, 9, 9])), [4, 3, 3]);
        assert_eq!(fair_shares(2, &wanting(&[1, 1, 1])), [1, 1, 0]);
    }

    #[test]
    fn weights_scale_the_level() {
        let c = [
            Claimant {
                wants: 100,
                weight: 1,
                floor: 0,
            },
            Claimant {
                wants: 100,
                weight: 3,
                floor: 0,
            },
        ];
        assert_eq!(fair_shares(40, &c), [10, 30]);
        // A heavy host that wants little leaves the rest to the light one.
        let c = [c[0], Claimant { wants: 5, ..c[1] }];
        assert_eq!(fair_shares(40, &c), [35, 5]);
    }

    #[test]
    fn floors_are_kept_whatever_a_host_wants_and_split_when_they_do_not_fit() {
        let idle = Claimant {
            wants: 0,
            weight: 1,
            floor: 5,
        };
        let busy = Claimant {
            wants: 100,
            weight: 1,
            floor: 5,
        };
        assert_eq!(fair_shares(60, &[idle, busy, busy]), [5, 28, 27]);
        assert_eq!(fair_shares(12, &[idle, idle, idle]), [4, 4, 4]);
        assert_eq!(fair_shares(0, &[idle, busy]), [0, 0]);
    }

    #[test]
    fn nobody_and_a_zero_total() {
        assert!(fair_shares(60, &[]).is_empty());
        assert_eq!(fair_shares(0, &wanting(&[3, 4])), [0, 0]);
    }

    fn claimants() -> impl Strategy<Value = Vec<Claimant>> {
        prop::collection::vec(
            (0u64..2_000, 1u32..8, prop_oneof![Just(0u64), 0u64..50]).prop_map(
                |(wants, weight, floor)| Claimant {
                    wants,
                    weight,
                    floor,
                },
            ),
            0..60,
        )
    }

    proptest! {
        #[test]
        fn shares_never_exceed_the_total_and_serve_all_demand_that_fits(
            total in 0u64..5_000,
            c in claimants(),
        ) {
            let shares = fair_shares(total, &c);
            prop_assert_eq!(shares.len(), c.len());
            let sum: u64 = shares.iter().sum();
            prop_assert!(sum <= total);
            let demand: u64 = c.iter().map(|c| c.wants.max(c.floor)).sum();
            prop_assert_eq!(sum, demand.min(total));
            for (s, c) in shares.iter().zip(&c) {
                prop_assert!(*s <= c.wants.max(c.floor));
            }
        }

        #[test]
        fn a_host_short_of_its_want_has_the_highest_level_but_one_unit(
            total in 0u64..5_000,
            wants in prop::collection::vec(0u64..2_000, 1..60),
            weights in prop::collection::vec(1u32..8, 60),
        ) {
            let c: Vec<Claimant> = wants
                .iter()
                .zip(&weights)
                .map(|(&wants, &weight)| Claimant { wants, weight, floor: 0 })
                .collect();
            let shares = fair_shares(total, &c);
            for (i, ci) in c.iter().enumerate() {
                if shares[i] >= ci.wants {
                    continue;
                }
                // Max-min: no host's share per unit of weight is above i's by more than
                // the unit rounding gave it.
                for (j, cj) in c.iter().enumerate() {
                    let (si, sj) = (u128::from(shares[i]), u128::from(shares[j]));
                    let (wi, wj) = (u128::from(ci.weight), u128::from(cj.weight));
                    prop_assert!(
                        sj.saturating_sub(1) * wi <= (si + 1) * wj,
                        "{i}: {si}/{wi} short of {}, {j}: {sj}/{wj}", ci.wants
                    );
                }
            }
        }

    }
}
