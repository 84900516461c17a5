use kvgate_kvcache::{BlockKeys, EndpointId};

use super::*;
use crate::cycle::{PrefixMatch, PrefixSource, RequestFacts};
use crate::framework::Picker;
use crate::plugins::pickers::max_score_picker::{MaxScorePicker, MaxScorePickerConfig};
use crate::test_util::{Ep, Fresh, ep, facts, setup};

/// Prefill tokens only (no KV terms), with the two switches.
fn scorer(in_flight_multiplier: bool, scraped_queue: bool) -> PrefillCostScorer {
    PrefillCostScorer::new(PrefillCostScorerConfig {
        new_kv_weight: 0.0,
        active_kv_weight: 0.0,
        kv_overflow_weight: 0.0,
        in_flight_multiplier,
        scraped_queue,
        fits_first: false,
        demand_spread: false,
        demand_slack: 1,
        demand_window_ms: 0,
        demand_floor: 0,
        prefill_progress: false,
    })
    .unwrap()
}

fn load(requests: u64, prefill_requests: u64, prefill_tokens: u64) -> LoadSnapshot {
    LoadSnapshot {
        requests,
        uncached_tokens: prefill_tokens,
        prefill_requests,
        prefill_tokens,
        ..LoadSnapshot::default()
    }
}

/// Each row flips one condition against the base row.
#[test]
fn cost_table() {
    let base = CostInput {
        prompt: Some(1000),
        cached: 0,
        load: LoadSnapshot::default(),
        waiting: None,
        running: None,
        capacity: None,
        unpinned_cached: 0,
    };
    type Row = (&'static str, CostInput, bool, bool, f64);
    let rows: Vec<Row> = vec![
        (
            "idle, nothing cached: the whole prompt",
            base,
            false,
            true,
            1000.0,
        ),
        (
            "600 cached",
            CostInput {
                cached: 600,
                ..base
            },
            false,
            true,
            400.0,
        ),
        (
            "all cached: still the last token",
            CostInput {
                cached: 1000,
                ..base
            },
            false,
            true,
            1.0,
        ),
        (
            "cached beyond the prompt",
            CostInput {
                cached: 4000,
                ..base
            },
            false,
            true,
            1.0,
        ),
        (
            "unknown prompt length",
            CostInput {
                prompt: None,
                ..base
            },
            false,
            true,
            1.0,
        ),
        (
            "empty prompt",
            CostInput {
                prompt: Some(0),
                ..base
            },
            false,
            true,
            1.0,
        ),
        (
            "queued prefill adds",
            CostInput {
                load: load(2, 2, 500),
                ..base
            },
            false,
            true,
            1500.0,
        ),
        (
            "decoding requests add no prefill",
            CostInput {
                load: load(3, 0, 0),
                ..base
            },
            false,
            true,
            1000.0,
        ),
        (
            "multiplier: × (in flight + 1)",
            CostInput {
                load: load(3, 0, 0),
                ..base
            },
            true,
            true,
            4000.0,
        ),
        (
            "scraped waiting beyond ours: other routers' work at our mean",
            CostInput {
                load: load(2, 2, 500),
                waiting: Some(4.0),
                ..base
            },
            false,
            true,
            2000.0,
        ),
        (
            "scraped waiting, none of ours: this request's size each",
            CostInput {
                waiting: Some(2.0),
                ..base
            },
            false,
            true,
            3000.0,
        ),
        (
            "scraped waiting not above ours: nothing added",
            CostInput {
                load: load(2, 2, 500),
                waiting: Some(1.0),
                ..base
            },
            false,
            true,
            1500.0,
        ),
        (
            "scraped queue off",
            CostInput {
                waiting: Some(2.0),
                ..base
            },
            false,
            false,
            1000.0,
        ),
        (
            "multiplier counts scraped running + waiting when larger",
            CostInput {
                waiting: Some(0.0),
                running: Some(3.0),
                ..base
            },
            true,
            true,
            4000.0,
        ),
        (
            "multiplier without scraped queue: only our count",
            CostInput {
                load: load(1, 0, 0),
                running: Some(3.0),
                ..base
            },
            true,
            false,
            2000.0,
        ),
    ];
    for (name, input, mult, scraped, want) in rows {
        assert_eq!(scorer(mult, scraped).cost(&input), want, "{name}");
    }
}

/// `prefill_progress`, one condition flipped per row: 500 pending tokens on an engine busy for
/// 1 ms at a learned 200,000 tokens/s (200 of them taken as done), then a 1000-token prompt.
#[test]
fn prefill_progress_table() {
    let busy = LoadSnapshot {
        prefill_busy_s: 0.001,
        prefill_rate: 200_000.0,
        ..load(2, 2, 500)
    };
    let base = CostInput {
        prompt: Some(1000),
        load: busy,
        ..CostInput::default()
    };
    let rows = [
        ("progress off: all pending counts", base, false, 1500.0),
        ("progress on: what is left", base, true, 1300.0),
        (
            "no rate learned yet",
            CostInput {
                load: LoadSnapshot {
                    prefill_rate: 0.0,
                    ..busy
                },
                ..base
            },
            true,
            1500.0,
        ),
        (
            "part of the period's work already left pending",
            CostInput {
                load: LoadSnapshot {
                    prefill_done_tokens: 150,
                    ..busy
                },
                ..base
            },
            true,
            1450.0,
        ),
        (
            "long past it: nothing left",
            CostInput {
                load: LoadSnapshot {
                    prefill_busy_s: 1.0,
                    ..busy
                },
                ..base
            },
            true,
            1000.0,
        ),
    ];
    for (name, input, progress, want) in rows {
        let s = PrefillCostScorer::new(PrefillCostScorerConfig {
            prefill_progress: progress,
            ..scorer(false, true).config
        })
        .unwrap();
        assert_eq!(s.cost(&input), want, "{name}");
    }
}

/// The KV terms, one weight flipped per row, on 600 cached of 1000 with 200 queued (and
/// allocated, and pinned) tokens in flight and a 1000-token cache.
#[test]
fn kv_terms_table() {
    let input = CostInput {
        prompt: Some(1000),
        cached: 600,
        load: LoadSnapshot {
            active_kv_tokens: 200,
            ..load(2, 1, 200)
        },
        waiting: None,
        running: None,
        capacity: Some(1000),
        unpinned_cached: 0,
    };
    // Q = 200, P = 400, U = 200, active KV A = 200; A + P = 600 fits.
    let rows = [
        ("prefill only", 0.0, 0.0, 0.0, None, 600.0),
        ("+ the KV it allocates", 1.0, 0.0, 0.0, None, 1000.0),
        ("+ KV in flight", 0.0, 1.0, 0.0, None, 800.0),
        (
            "overflow: fits, nothing added",
            0.0,
            0.0,
            1.0,
            Some(1000),
            600.0,
        ),
        (
            "overflow: 100 over a 500-token cache",
            0.0,
            0.0,
            1.0,
            Some(500),
            700.0,
        ),
        ("overflow halved", 0.0, 0.0, 0.5, Some(500), 650.0),
        ("capacity never scraped", 0.0, 0.0, 1.0, None, 600.0),
    ];
    for (name, new_kv_weight, active_kv_weight, kv_overflow_weight, capacity, want) in rows {
        let s = PrefillCostScorer::new(PrefillCostScorerConfig {
            new_kv_weight,
            active_kv_weight,
            kv_overflow_weight,
            ..PrefillCostScorerConfig::default()
        })
        .unwrap();
        let input = CostInput { capacity, ..input };
        assert_eq!(s.cost(&input), want, "{name}");
    }
    for bad in [-1.0, f64::NAN, f64::INFINITY] {
        let e = PrefillCostScorer::new(PrefillCostScorerConfig {
            kv_overflow_weight: bad,
            ..PrefillCostScorerConfig::default()
        })
        .unwrap_err();
        assert!(e.to_string().contains("kv_overflow_weight"), "{e}");
    }
}

/// A sibling of a request still prefilling: the holder costs its queue + 1 token, another
/// engine the whole prompt. Prefill alone calls it nearly even and picks the idle engine
/// (duplicating the prefix); counting the KV it allocates keeps it with its sibling.
#[test]
fn a_burst_sibling_joins_the_engine_computing_its_prefix() {
    let holder = CostInput {
        prompt: Some(512),
        cached: 512,
        load: load(1, 1, 512),
        waiting: None,
        running: None,
        capacity: None,
        unpinned_cached: 0,
    };
    let idle = CostInput {
        cached: 0,
        load: LoadSnapshot::default(),
        ..holder
    };
    let prefill_only = scorer(false, true);
    assert!(prefill_only.cost(&holder) > prefill_only.cost(&idle));
    let default = PrefillCostScorer::new(PrefillCostScorerConfig::default()).unwrap();
    assert!(default.cost(&holder) < default.cost(&idle));
}

pub(super) fn facts_with_prompt(n: u64) -> RequestFacts {
    let mut f = facts().with_tokens((0..n as u32).collect::<Vec<u32>>(), true, vec![]);
    f.prompt_tokens = Some(n);
    f
}

/// Scores through the trait: the prefix match recorded earlier in the run is read, the cheapest
/// scores 1 and the others min/cost.
#[test]
fn scores_relative_to_the_cheapest() {
    let s = scorer(false, true);
    let eps = [
        ep("a:1").kv_id(1, true),
        ep("b:1").kv_id(2, true).load(1, 200),
    ];
    let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
    cycle.record_prefix_match(PrefixMatch {
        source: PrefixSource::Precise,
        predicted: vec![(EndpointId(1), 0), (EndpointId(2), 800)],
    });
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut out = vec![0.0; 2];
    assert_eq!(s.score(&mut cycle, &refs, &mut out), ScoreOutcome::Scored);
    // a: 0 queued + 1000 new; b: 200 queued + 200 new = 400.
    assert_eq!(out, vec![0.4, 1.0]);
}

/// Inside a run the scorer costs the loads the run read (through the cycle), not loads of
/// its own: here they say the reverse of the endpoints' own, and the scores follow them.
/// Outside a run (no loads given, or a count that does not match) it reads its own.
#[test]
fn the_run_s_loads_are_the_ones_costed() {
    let s = scorer(false, true);
    let eps = [ep("a:1"), ep("b:1").load(1, 200)];
    let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut out = vec![0.0; 2];
    let own = vec![1.0, 1000.0 / 1200.0];
    let given = vec![1000.0 / 1200.0, 1.0];
    let rows = [
        ("no loads given", vec![], own.clone()),
        (
            "a count that does not match",
            vec![LoadSnapshot::default()],
            own,
        ),
        (
            "the run's loads",
            vec![load(1, 1, 200), LoadSnapshot::default()],
            given,
        ),
    ];
    for (name, loads, want) in rows {
        cycle.set_loads(loads);
        assert_eq!(s.score(&mut cycle, &refs, &mut out), ScoreOutcome::Scored);
        assert_eq!(out, want, "{name}");
    }
}

#[test]
fn stale_metrics_are_not_read() {
    let s = scorer(false, true);
    let eps = [
        ep("a:1").waiting(5.0).fresh(Fresh::Stale),
        ep("b:1").waiting(1.0),
    ];
    let (built, mut cycle) = setup(&eps, facts_with_prompt(100));
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut out = vec![0.0; 2];
    s.score(&mut cycle, &refs, &mut out);
    // a: stale, so 100; b: one waiting request of ~100 tokens from elsewhere + 100.
    assert_eq!(out, vec![1.0, 0.5]);
}

/// Equal costs: the picker takes fewest decode tokens, then the least recently picked.
#[test]
fn ties_go_to_fewest_decode_tokens_then_least_recently_picked() {
    let s = scorer(false, true);
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    let eps = [ep("a:1"), ep("b:1"), ep("c:1")];
    let (built, _) = setup(&eps, facts_with_prompt(100));
    // Pick order c, a, b; then a and b each get one decoding request, c none.
    let mut guards = vec![
        built[2].begin_request(0, 0),
        built[0].begin_request(0, 50),
        built[1].begin_request(0, 50),
    ];
    for g in &mut guards[1..] {
        g.prefill_done();
    }
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let pick = |refs: &[&EndpointState]| {
        let mut cycle = CycleState::new(facts_with_prompt(100), std::time::Instant::now());
        let mut out = vec![0.0; refs.len()];
        s.score(&mut cycle, refs, &mut out);
        picker
            .pick(&mut cycle, &out)
            .map(|i| refs[i].name().to_owned())
    };
    assert_eq!(pick(&refs).as_deref(), Some("c:1"), "fewest decode tokens");
    assert_eq!(
        pick(&refs[..2]).as_deref(),
        Some("a:1"),
        "least recently picked"
    );
    drop(guards);
}

/// Costs within one KV block of the cheapest are ties, ordered by fewest uncached tokens.
#[test]
fn costs_within_a_block_tie_and_the_smaller_computation_wins() {
    let s = PrefillCostScorer::new(PrefillCostScorerConfig {
        new_kv_weight: 1.0,
        ..PrefillCostScorerConfig::default()
    })
    .unwrap();
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    let eps = [
        ep("a:1").kv_id(1, true),
        ep("b:1").kv_id(2, true),
        ep("c:1").kv_id(3, true).load(1, 100),
    ];
    let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
    cycle.record_prefix_match(PrefixMatch {
        source: PrefixSource::Precise,
        predicted: vec![(EndpointId(1), 0), (EndpointId(2), 8), (EndpointId(3), 0)],
    });
    let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
    let mut out = vec![0.0; 3];
    s.score(&mut cycle, &refs, &mut out);
    // a: 2 × 1000 = 2000; b: 2 × 992 = 1984; c: 100 + 2000 = 2100.
    assert_eq!(out[..2], [1.0, 1.0], "16 tokens apart: a tie");
    assert_eq!(out[2], 1984.0 / 2100.0);
    assert_eq!(
        picker.pick(&mut cycle, &out),
        Some(1),
        "b computes 8 tokens less"
    );
}

/// A predicted hit counts at the share the engine recently realized.
#[test]
fn predicted_hits_count_at_the_realized_share() {
    let s = scorer(false, true);
    let mut input = CostInput {
        prompt: Some(1000),
        cached: 800,
        ..CostInput::default()
    };
    assert_eq!(s.cost(&input), 200.0, "predictions hold");
    input.load.realized_share = 0.5;
    assert_eq!(s.cost(&input), 600.0, "half of them held lately");
}

/// Fits first: a candidate where the request's KV does not fit ranks after every candidate
/// where it does, whatever its prefill cost; the rows flip one condition each.
#[test]
fn candidates_where_the_request_does_not_fit_rank_last() {
    // Two candidates, 1,000-token prompt: "hot" predicts 900 cached and pins `hot_kv` tokens
    // of KV for requests in flight; "cold" holds nothing and is idle. Capacity 100 blocks of
    // 16 = 1,600 tokens on each (None: never scraped).
    type Row = (&'static str, bool, u64, Option<u64>, &'static str);
    let rows: [Row; 5] = [
        ("hot fits: its hit wins", true, 1400, Some(100), "hot:1"),
        (
            "hot overflows: the cold one that fits wins",
            true,
            1600,
            Some(100),
            "cold:1",
        ),
        (
            "fits_first off: the overflow term alone keeps hot",
            false,
            1600,
            Some(100),
            "hot:1",
        ),
        (
            "capacity unknown: nothing overflows",
            true,
            1600,
            None,
            "hot:1",
        ),
        ("a larger engine fits again", true, 1600, Some(200), "hot:1"),
    ];
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    for (name, fits_first, hot_kv, blocks, want) in rows {
        let s = PrefillCostScorer::new(PrefillCostScorerConfig {
            fits_first,
            ..PrefillCostScorerConfig::default()
        })
        .unwrap();
        let with_capacity = |e: Ep| match blocks {
            Some(b) => e.capacity(b, 16),
            None => e,
        };
        let eps = [
            with_capacity(ep("hot:1").kv_id(1, true)),
            with_capacity(ep("cold:1").kv_id(2, true)),
        ];
        let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
        // One decoding request on hot pins `hot_kv` tokens (no keys: all unshared).
        let mut guard = built[0].begin_request(0, hot_kv);
        guard.prefill_done();
        cycle.record_prefix_match(PrefixMatch {
            source: PrefixSource::Precise,
            predicted: vec![(EndpointId(1), 900), (EndpointId(2), 0)],
        });
        let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
        let mut out = vec![0.0; 2];
        s.score(&mut cycle, &refs, &mut out);
        let picked = picker.pick(&mut cycle, &out).map(|i| refs[i].name());
        assert_eq!(picked, Some(want), "{name}: scores {out:?}");
        drop(guard);
    }
}

#[test]
fn rank_by_tier_puts_each_tier_after_the_lower_ones() {
    use Tier::{Fits, Overflows, Saturated};
    type Row = (&'static str, Vec<f64>, Vec<Tier>, Vec<f64>);
    let rows: [Row; 5] = [
        (
            "mixed",
            vec![10.0, 5.0, 30.0],
            vec![Fits, Overflows, Fits],
            vec![10.0, 35.0, 30.0],
        ),
        (
            "all fit",
            vec![10.0, 5.0],
            vec![Fits, Fits],
            vec![10.0, 5.0],
        ),
        (
            "all overflow",
            vec![10.0, 5.0],
            vec![Overflows, Overflows],
            vec![10.0, 5.0],
        ),
        (
            "saturated after fits, overflow after both",
            vec![10.0, 5.0, 1.0],
            vec![Fits, Saturated, Overflows],
            vec![10.0, 15.0, 16.0],
        ),
        (
            "no fit: saturated first",
            vec![10.0, 5.0],
            vec![Overflows, Saturated],
            vec![15.0, 5.0],
        ),
    ];
    for (name, mut costs, tiers, want) in rows {
        rank_by_tier(&mut costs, &tiers);
        assert_eq!(costs, want, "{name}");
    }
}

/// The predicted hit's blocks that no request in flight pins must fit too. One request of 800
/// prompt tokens is in flight on the holder; the rows differ only in whether it pins this
/// prompt's first 50 blocks.
#[test]
fn an_unpinned_hit_counts_toward_the_fit() {
    let s = PrefillCostScorer::new(PrefillCostScorerConfig::default()).unwrap();
    let picker = MaxScorePicker::new(MaxScorePickerConfig::default()).unwrap();
    let eps = [
        ep("hot:1").kv_id(1, true).capacity(100, 16),
        ep("cold:1").kv_id(2, true).capacity(100, 16),
    ];
    for (name, shares_the_prefix, want) in [
        (
            "another prompt: 800 in flight + 896 unpinned hit + 104 new > 1,600",
            false,
            "cold:1",
        ),
        (
            "the same prefix: 800 in flight + 96 unpinned hit + 104 new fits",
            true,
            "hot:1",
        ),
    ] {
        let (built, mut cycle) = setup(&eps, facts_with_prompt(1000));
        let keys = cycle.block_keys(16).unwrap();
        let in_flight_keys = shares_the_prefix.then(|| {
            std::sync::Arc::new(BlockKeys {
                keys: keys.keys[..50].to_vec(),
                block_size: 16,
            })
        });
        let mut in_flight = built[0].begin_request_with_keys(0, 800, in_flight_keys);
        in_flight.prefill_done();
        cycle.record_prefix_match(PrefixMatch {
            source: PrefixSource::Precise,
            predicted: vec![(EndpointId(1), 896), (EndpointId(2), 0)],
        });
        let refs: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
        let mut out = vec![0.0; 2];
        s.score(&mut cycle, &refs, &mut out);
        let picked = picker.pick(&mut cycle, &out).map(|i| refs[i].name());
        assert_eq!(picked, Some(want), "{name}: scores {out:?}");
        drop(in_flight);
    }
}

/// With the default weights a continuation stays on its holder through a queue of a few
/// prefills and moves only when the queue outweighs its recomputed prefix about elevenfold;
/// at `new_kv_weight` 1 the middle row moved. One condition (the holder's queue) per row.
#[test]
fn a_holder_keeps_its_continuation_through_a_transient_queue() {
    let default = PrefillCostScorer::new(PrefillCostScorerConfig::default()).unwrap();
    let light = PrefillCostScorer::new(PrefillCostScorerConfig {
        new_kv_weight: 1.0,
        ..PrefillCostScorerConfig::default()
    })
    .unwrap();
    let input = |cached: u64, queued: u64| CostInput {
        prompt: Some(1000),
        cached,
        load: load(1, 1, queued),
        waiting: None,
        running: None,
        capacity: None,
        unpinned_cached: 0,
    };
    // The holder has 800 of the 1000 tokens; the other engine is idle and holds nothing.
    let rows = [
        ("idle holder", 0, true, true),
        ("holder busy with 4,000 tokens", 4_000, true, false),
        ("holder busy with 20,000 tokens", 20_000, false, false),
    ];
    for (name, queued, stays, stays_at_weight_1) in rows {
        for (s, want) in [(&default, stays), (&light, stays_at_weight_1)] {
            let holder = s.cost(&input(800, queued));
            let other = s.cost(&CostInput {
                load: LoadSnapshot::default(),
                ..input(0, 0)
            });
            assert_eq!(
                holder < other,
                want,
                "{name}, new_kv_weight {}: holder {holder}, other {other}",
                s.config.new_kv_weight
            );
        }
    }
}
