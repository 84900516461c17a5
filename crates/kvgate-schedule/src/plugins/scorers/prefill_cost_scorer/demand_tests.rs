//! `demand_spread`: a holder serving more than its share of other sequences with the
//! request's predicted prefix ranks after the candidates where that is not so.

use std::sync::Arc;
use std::time::Instant;

use kvgate_kvcache::{
    BlockKey, BlockKeys, BlockStored, EndpointId, EndpointKey, EndpointSpec, IndexConfig, KvEvent,
    KvIndex, KvMetrics,
};

use super::tests::facts_with_prompt;
use super::*;
use crate::cycle::{CycleState, PrefixMatch, PrefixSource};
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
/// tokens (56 blocks) and runs the requests in `sharers`; `cold` predicts nothing, runs
/// `cold_busy` unrelated requests and holds `cold_held` blocks of other prefixes (the index's
/// confirmed holdings). Each row flips one condition against the first two.
#[test]
fn a_holder_over_its_share_of_a_prefix_ranks_after_a_free_engine() {
    type Row = (
        &'static str,
        Sharers,
        usize,
        (u32, u32),
        bool,
        u64,
        u64,
        &'static str,
    );
    let rows: [Row; 11] = [
        (
            "one other session: share 1 + 1 not reached",
            Sharers::Distinct(1),
            0,
            (1, 0),
            true,
            1000,
            0,
            "hot:1",
        ),
        (
            "two other sessions: share 1 + 1 reached",
            Sharers::Distinct(2),
            0,
            (1, 0),
            true,
            1000,
            0,
            "cold:1",
        ),
        (
            "two copies of the same prompt are one sequence",
            Sharers::Identical(2),
            0,
            (1, 0),
            true,
            1000,
            0,
            "hot:1",
        ),
        (
            "demand_spread off",
            Sharers::Distinct(2),
            0,
            (1, 0),
            false,
            1000,
            0,
            "hot:1",
        ),
        (
            "demand_slack 2",
            Sharers::Distinct(2),
            0,
            (2, 0),
            true,
            1000,
            0,
            "hot:1",
        ),
        (
            "the fleet is as busy elsewhere: share 2 + 1",
            Sharers::Distinct(2),
            2,
            (1, 0),
            true,
            1000,
            0,
            "hot:1",
        ),
        (
            "the request does not fit on cold",
            Sharers::Distinct(2),
            0,
            (1, 0),
            true,
            10,
            0,
            "hot:1",
        ),
        (
            "cold is full of other cached blocks: a copy would evict them",
            Sharers::Distinct(2),
            0,
            (1, 0),
            true,
            1000,
            960,
            "hot:1",
        ),
        (
            "cold holds other blocks but has room for the copy",
            Sharers::Distinct(2),
            0,
            (1, 0),
            true,
            1000,
            900,
            "cold:1",
        ),
        (
            "floor 3: two other sessions stay",
            Sharers::Distinct(2),
            0,
            (0, 3),
            true,
            1000,
            0,
            "hot:1",
        ),
        (
            "floor 2: two other sessions reach it",
            Sharers::Distinct(2),
            0,
            (0, 2),
            true,
            1000,
            0,
            "cold:1",
        ),
    ];
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    for (
        name,
        sharers,
        cold_busy,
        (demand_slack, demand_floor),
        demand_spread,
        cold_blocks,
        cold_held,
        want,
    ) in rows
    {
        let index = index_holding(cold_held);
        let s = PrefillCostScorer::with_index(
            PrefillCostScorerConfig {
                demand_spread,
                demand_slack,
                demand_floor,
                demand_window_ms: 0,
                ..PrefillCostScorerConfig::default()
            },
            &index,
        )
        .unwrap();
        let eps = [
            ep("hot:1").kv_id(1, true).capacity(1000, 16),
            ep("cold:1").kv_id(2, true).capacity(cold_blocks, 16),
        ];
        let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
        let keys = cycle.block_keys(16).unwrap();
        assert_eq!(keys.keys.len(), 62);
        let mut guards = sharer_guards(&built[0], &keys, sharers);
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

/// An index where endpoint 2 (`cold`) holds `blocks` blocks of a prefix nobody asks for.
/// Begins `sharers` requests on `hot`: prompts sharing the first 56 of `keys`' blocks with
/// tails of their own, or copies of `keys`.
fn sharer_guards(
    hot: &Arc<EndpointState>,
    keys: &BlockKeys,
    sharers: Sharers,
) -> Vec<InFlightGuard> {
    let (n, distinct) = match sharers {
        Sharers::Distinct(n) => (n, true),
        Sharers::Identical(n) => (n, false),
    };
    (0..n)
        .map(|i| {
            let mut k = keys.keys.clone();
            if distinct {
                k.truncate(56);
                k.extend((0..6).map(|j| BlockKey(u64::MAX - (i * 8 + j) as u64)));
            }
            let keys = Arc::new(BlockKeys {
                keys: k,
                block_size: 16,
            });
            hot.begin_request_with_keys(100, 1000, Some(keys))
        })
        .collect()
}

/// The even share follows the fleet's recent peak of requests in flight, not the count at the
/// pick: `hot` serves two other sessions of the prefix while `cold` runs six unrelated
/// requests (8 in flight on 2 engines: a share of 4, `hot` keeps the request); the six end,
/// and at the next pick only the two remain (a share of 1: saturated, unless the peak counts).
#[test]
fn the_share_follows_the_recent_peak_of_requests_in_flight() {
    let rows: [(&str, u64, &str); 2] = [
        ("a 10 s window remembers the 8", 10_000, "hot:1"),
        ("no window: only the 2 at the pick", 0, "cold:1"),
    ];
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    for (name, demand_window_ms, want_after) in rows {
        let index = index_holding(0);
        let s = PrefillCostScorer::with_index(
            PrefillCostScorerConfig {
                demand_slack: 0,
                demand_floor: 0,
                demand_window_ms,
                ..PrefillCostScorerConfig::default()
            },
            &index,
        )
        .unwrap();
        let eps = [
            ep("hot:1").kv_id(1, true).capacity(1000, 16),
            ep("cold:1").kv_id(2, true).capacity(1000, 16),
        ];
        let (built, mut first) = setup(&eps, facts_with_prompt(1000));
        let keys = first.block_keys(16).unwrap();
        let _sharers = sharer_guards(&built[0], &keys, Sharers::Distinct(2));
        let busy: Vec<InFlightGuard> = (0..6).map(|_| built[1].begin_request(0, 10)).collect();
        let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
        let pick = |mut cycle: CycleState| {
            // The prefix scorer computes the block keys before this scorer reads them.
            cycle.block_keys(16).unwrap();
            cycle.record_prefix_match(PrefixMatch {
                source: PrefixSource::Precise,
                predicted: vec![(EndpointId(1), 896), (EndpointId(2), 0)],
            });
            let mut out = vec![0.0; 2];
            s.score(&mut cycle, &refs, &mut out);
            picker.pick(&mut cycle, &out).map(|i| refs[i].name())
        };
        assert_eq!(pick(first), Some("hot:1"), "{name}: at the peak");
        drop(busy);
        let later = CycleState::new(facts_with_prompt(1000), Instant::now());
        assert_eq!(pick(later), Some(want_after), "{name}: after the peak");
    }
}

fn index_holding(blocks: u64) -> KvIndex {
    let index = KvIndex::new(IndexConfig::default(), KvMetrics::unregistered());
    for a in ["unused:1", "hot:1", "cold:1"] {
        index.register_endpoint(EndpointSpec {
            key: EndpointKey::new(a, 0),
            model: "m".into(),
            block_size: 16,
            capacity_blocks: None,
        });
    }
    if blocks > 0 {
        let stored = KvEvent::BlockStored(BlockStored {
            block_hashes: (1_000_000..1_000_000 + blocks).map(Into::into).collect(),
            token_ids: (0..blocks as u32 * 16).map(|t| 100_000 + t).collect(),
            block_size: 16,
            ..BlockStored::default()
        });
        index.apply_event(EndpointId(2), &stored);
    }
    assert_eq!(index.holdings(EndpointId(2)), blocks as usize);
    index
}

/// The tiers `demand_spread` ends with: a saturated holder ranks after the fitting
/// candidates only when one of them has free room; those without it then rank after the
/// holder. Each row flips one condition.
#[test]
fn a_saturated_holder_yields_only_to_free_room() {
    use Tier::{Crowded, Fits, Overflows, Saturated};
    type Row = (&'static str, Vec<Tier>, Vec<bool>, Vec<Tier>);
    let rows: Vec<Row> = vec![
        (
            "no saturated holder: nothing changes",
            vec![Fits, Fits, Overflows],
            vec![true, false, false],
            vec![Fits, Fits, Overflows],
        ),
        (
            "a free engine: the holder yields, the full engine ranks after it",
            vec![Saturated, Fits, Fits],
            vec![false, true, false],
            vec![Saturated, Fits, Crowded],
        ),
        (
            "no free engine: the holder is not held back",
            vec![Saturated, Fits, Fits],
            vec![false, false, false],
            vec![Fits, Fits, Fits],
        ),
        (
            "room only where the request overflows does not count",
            vec![Saturated, Overflows],
            vec![false, true],
            vec![Fits, Overflows],
        ),
    ];
    for (name, mut tiers, spare, want) in rows {
        spread_to_spare_room(&mut tiers, &spare);
        assert_eq!(tiers, want, "{name}");
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
