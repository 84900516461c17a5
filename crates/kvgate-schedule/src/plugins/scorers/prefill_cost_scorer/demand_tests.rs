//! `demand_spread`: a holder serving more than its share of other sequences with the
//! request's predicted prefix ranks after the candidates where that is not so.

use std::sync::Arc;

use kvgate_kvcache::{BlockKey, BlockKeys, EndpointId};

use super::tests::facts_with_prompt;
use super::*;
use crate::cycle::{PrefixMatch, PrefixSource};
use crate::framework::Picker;
use crate::load::InFlightGuard;
use crate::plugins::pickers::max_score_picker::{MaxScorePicker, MaxScorePickerConfig};
use crate::test_util::{ep, setup};

/// What is in flight on the holder before the request is scored.
#[derive(Clone, Copy)]
enum Sharers {
    /// `n` other sequences: this prompt's first 56 blocks, then a tail of their own.
    Distinct(usize),
    /// `n` copies of this very prompt (a sampling burst).
    Identical(usize),
}

/// Two candidates, a 1,000-token prompt (62 full blocks of 16): `hot` predicts 896 cached
/// tokens (56 blocks) and runs the requests in `sharers`; `cold` predicts nothing and runs
/// `cold_busy` unrelated requests. Each row flips one condition against the first two.
#[test]
fn a_holder_over_its_share_of_a_prefix_ranks_after_a_free_engine() {
    type Row = (&'static str, Sharers, usize, u32, bool, u64, &'static str);
    let rows: [Row; 7] = [
        (
            "one other session: share 1 + 1 not reached",
            Sharers::Distinct(1),
            0,
            1,
            true,
            1000,
            "hot:1",
        ),
        (
            "two other sessions: share 1 + 1 reached",
            Sharers::Distinct(2),
            0,
            1,
            true,
            1000,
            "cold:1",
        ),
        (
            "two copies of the same prompt are one sequence",
            Sharers::Identical(2),
            0,
            1,
            true,
            1000,
            "hot:1",
        ),
        (
            "demand_spread off",
            Sharers::Distinct(2),
            0,
            1,
            false,
            1000,
            "hot:1",
        ),
        (
            "demand_slack 2",
            Sharers::Distinct(2),
            0,
            2,
            true,
            1000,
            "hot:1",
        ),
        (
            "the fleet is as busy elsewhere: share 2 + 1",
            Sharers::Distinct(2),
            2,
            1,
            true,
            1000,
            "hot:1",
        ),
        (
            "the request does not fit on cold",
            Sharers::Distinct(2),
            0,
            1,
            true,
            10,
            "hot:1",
        ),
    ];
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    for (name, sharers, cold_busy, demand_slack, demand_spread, cold_blocks, want) in rows {
        let s = PrefillCostScorer::new(PrefillCostScorerConfig {
            demand_spread,
            demand_slack,
            ..PrefillCostScorerConfig::default()
        })
        .unwrap();
        let eps = [
            ep("hot:1").kv_id(1, true).capacity(1000, 16),
            ep("cold:1").kv_id(2, true).capacity(cold_blocks, 16),
        ];
        let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
        let keys = cycle.block_keys(16).unwrap();
        assert_eq!(keys.keys.len(), 62);
        let mut guards: Vec<InFlightGuard> = Vec::new();
        let (n, distinct) = match sharers {
            Sharers::Distinct(n) => (n, true),
            Sharers::Identical(n) => (n, false),
        };
        for i in 0..n {
            let mut k = keys.keys.clone();
            if distinct {
                k.truncate(56);
                k.extend((0..6).map(|j| BlockKey(u64::MAX - (i * 8 + j) as u64)));
            }
            let keys = Arc::new(BlockKeys {
                keys: k,
                block_size: 16,
            });
            guards.push(built[0].begin_request_with_keys(100, 1000, Some(keys)));
        }
        for _ in 0..cold_busy {
            let mut g = built[1].begin_request(0, 10);
            g.prefill_done();
            guards.push(g);
        }
        cycle.record_prefix_match(PrefixMatch {
            source: PrefixSource::Precise,
            predicted: vec![(EndpointId(1), 896), (EndpointId(2), 0)],
        });
        let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
        let mut out = vec![0.0; 2];
        s.score(&mut cycle, &refs, &mut out);
        let picked = picker.pick(&mut cycle, &out).map(|i| refs[i].name());
        assert_eq!(picked, Some(want), "{name}: scores {out:?}");
    }
}

/// The sharer count itself: other sequences through the prefix's last block, copies of the
/// prompt excluded, nothing for an empty prefix or another block size.
#[test]
fn prefix_sharers_count_other_sequences_only() {
    let e = ep("a:1").build(std::time::Instant::now());
    let chain = |tail: u64| BlockKeys {
        keys: vec![BlockKey(1), BlockKey(2), BlockKey(tail)],
        block_size: 16,
    };
    let _a = e.begin_request_with_keys(1, 48, Some(Arc::new(chain(3))));
    let _b = e.begin_request_with_keys(1, 48, Some(Arc::new(chain(4))));
    let _c = e.begin_request_with_keys(1, 48, Some(Arc::new(chain(5))));
    let mine = chain(3);
    assert_eq!(
        e.prefix_sharers(&mine, 2),
        2,
        "b and c share two blocks, a is a copy"
    );
    assert_eq!(
        e.prefix_sharers(&chain(9), 2),
        3,
        "a new tail: all three share"
    );
    assert_eq!(e.prefix_sharers(&mine, 0), 0, "no prefix");
    let other_size = BlockKeys {
        block_size: 32,
        ..chain(9)
    };
    assert_eq!(
        e.prefix_sharers(&other_size, 2),
        0,
        "keyed with another block size"
    );
}
