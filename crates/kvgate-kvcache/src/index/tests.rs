use std::sync::Arc;

use super::*;
use crate::clock::ManualClock;
use crate::event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, KvEventBatch};
use crate::keys::{KeyScope, MmSpan, block_keys, block_keys_with_mm};

const M: &str = "meta-llama/Llama-3.1-8B-Instruct";

fn index_with(clock: ManualClock, capacity: usize) -> KvIndex {
    let cfg = IndexConfig {
        default_capacity_blocks: capacity,
        ..IndexConfig::default()
    };
    KvIndex::with_clock(cfg, KvMetrics::unregistered(), Arc::new(clock))
}

fn index() -> KvIndex {
    index_with(ManualClock::new(1_000), 1 << 20)
}

fn ep(ix: &KvIndex, name: &str) -> EndpointId {
    ix.register_endpoint(EndpointSpec {
        key: EndpointKey::new(name, 0),
        model: M.into(),
        block_size: 16,
        capacity_blocks: None,
    })
}

/// An endpoint whose holdings the index bounds at `capacity`.
fn bounded_ep(ix: &KvIndex, name: &str, capacity: usize) -> EndpointId {
    ix.register_endpoint(EndpointSpec {
        key: EndpointKey::new(name, 0),
        model: M.into(),
        block_size: 16,
        capacity_blocks: Some(capacity),
    })
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>) -> BlockStored {
    BlockStored {
        block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
        parent_block_hash: parent.map(BlockHash::Int),
        token_ids: tokens.collect(),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    }
}

fn keys_of(ix: &KvIndex, id: EndpointId) -> Vec<BlockKey> {
    ix.endpoint_blocks(id)
        .into_iter()
        .filter(|(_, t)| *t == Tier::Gpu)
        .map(|(k, _)| k)
        .collect()
}

fn sorted(mut v: Vec<BlockKey>) -> Vec<BlockKey> {
    v.sort_unstable();
    v
}

#[test]
fn event_keys_equal_request_keys() {
    let ix = index();
    let a = ep(&ix, "a");
    ix.apply_event(
        a,
        &KvEvent::BlockStored(stored(&[101, 102, 103], None, 1..49)),
    );
    // Continuation chained through the parent engine hash.
    ix.apply_event(a, &KvEvent::BlockStored(stored(&[104], Some(103), 49..65)));
    let toks: Vec<u32> = (1..65).collect();
    let want = block_keys(
        &toks,
        16,
        KeyScope {
            model: M,
            cache_salt: None,
        },
    );
    assert_eq!(keys_of(&ix, a), sorted(want.keys.clone()));
    let s = ix.score(&want, &[a]);
    assert_eq!(
        s.get(a)
            .map(|e| (e.matched_blocks, e.predicted_cached_tokens)),
        Some((4, 64))
    );
    assert_eq!(s.score_of(a), 1.0);
}

#[test]
fn extra_keys_classification_matches_request_side() {
    let toks: Vec<u32> = (1..33).collect();
    let s = |x: &str| ExtraKey::Str(x.into());
    let mm = |id: &str, off| ExtraKey::Mm {
        identifier: id.into(),
        offset: off,
    };
    let img = MmSpan {
        identifier: "img".into(),
        offset: 3,
        length: 20,
    };
    // (name, lora_name, extra_keys, request model, request salt, request mm)
    type Case = (
        &'static str,
        Option<&'static str>,
        Option<Vec<Option<Vec<ExtraKey>>>>,
        &'static str,
        Option<&'static str>,
        Vec<MmSpan>,
    );
    let cases: Vec<Case> = vec![
        ("plain", None, None, M, None, vec![]),
        ("nil extras", None, Some(vec![None, None]), M, None, vec![]),
        (
            "lora name stripped, model = adapter",
            Some("ad"),
            Some(vec![Some(vec![s("ad")]), Some(vec![s("ad")])]),
            "ad",
            None,
            vec![],
        ),
        (
            "salt in block 0",
            None,
            Some(vec![Some(vec![s("salty")]), None]),
            M,
            Some("salty"),
            vec![],
        ),
        (
            "lora + salt",
            Some("ad"),
            Some(vec![Some(vec![s("ad"), s("salty")]), Some(vec![s("ad")])]),
            "ad",
            Some("salty"),
            vec![],
        ),
        (
            "mm over two blocks",
            None,
            Some(vec![Some(vec![mm("img", 3)]), Some(vec![mm("img", -13)])]),
            M,
            None,
            vec![img.clone()],
        ),
        (
            "two images: the second shares the first's last block",
            None,
            Some(vec![
                Some(vec![mm("img", 3)]),
                Some(vec![mm("img", -13), mm("img2", 8)]),
            ]),
            M,
            None,
            vec![
                MmSpan {
                    identifier: "img2".into(),
                    offset: 24,
                    length: 4,
                },
                img.clone(),
            ],
        ),
        (
            "lora + mm + salt",
            Some("ad"),
            Some(vec![
                Some(vec![s("ad"), mm("img", 3), s("salty")]),
                Some(vec![s("ad"), mm("img", -13)]),
            ]),
            "ad",
            Some("salty"),
            vec![img.clone()],
        ),
    ];
    for (name, lora, extra, model, salt, mms) in cases {
        let ix = index();
        let a = ep(&ix, "a");
        let mut ev = stored(&[1, 2], None, 1..33);
        ev.lora_name = lora.map(str::to_owned);
        ev.extra_keys = extra;
        ix.apply_event(a, &KvEvent::BlockStored(ev));
        let want = block_keys_with_mm(
            &toks,
            16,
            KeyScope {
                model,
                cache_salt: salt,
            },
            &mms,
        );
        assert_eq!(keys_of(&ix, a), sorted(want.keys.clone()), "{name}");
        assert_eq!(
            ix.score(&want, &[a]).get(a).map(|e| e.matched_blocks),
            Some(2),
            "{name}"
        );
    }
}

#[test]
fn removal_placeholders_clear_and_groups() {
    let toks: Vec<u32> = (1..49).collect();
    let keys = block_keys(
        &toks,
        16,
        KeyScope {
            model: M,
            cache_salt: None,
        },
    );
    let setup = || {
        let ix = index();
        let a = ep(&ix, "a");
        ix.apply_event(
            a,
            &KvEvent::BlockStored(stored(&[101, 102, 103], None, 1..49)),
        );
        (ix, a)
    };
    let removed = |hashes: &[u64], medium: &str| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.iter().map(|h| BlockHash::Int(*h)).collect(),
            medium: Some(medium.into()),
            ..Default::default()
        })
    };
    let cpu_placeholder = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![BlockHash::Int(101), BlockHash::Int(102)],
        medium: Some("CPU".into()),
        ..Default::default()
    });
    let mut sliding = stored(&[201], None, 1..17);
    sliding.kv_cache_spec_kind = Some("sliding_window".into());
    sliding.group_idx = Some(1);
    let sliding_removed = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![BlockHash::Int(101)],
        group_idx: Some(1),
        ..Default::default()
    });
    // (name, events, want matched blocks, want score ×100, want holdings)
    let cases: Vec<(&str, Vec<KvEvent>, u32, u32, usize)> = vec![
        ("stored only", vec![], 3, 100, 3),
        (
            "remove middle block stops the prefix",
            vec![removed(&[102], "GPU")],
            1,
            33,
            2,
        ),
        (
            "remove unknown hash is ignored",
            vec![removed(&[999], "GPU")],
            3,
            100,
            3,
        ),
        (
            "cpu placeholder adds a tier",
            vec![cpu_placeholder.clone()],
            3,
            100,
            5,
        ),
        (
            "gpu evicted, cpu copy remains",
            vec![cpu_placeholder.clone(), removed(&[101, 102], "GPU")],
            3,
            87,
            3,
        ),
        (
            "cpu removal after gpu removal drops all",
            vec![
                cpu_placeholder,
                removed(&[101], "GPU"),
                removed(&[101], "CPU"),
            ],
            0,
            0,
            3,
        ),
        (
            "all blocks cleared",
            vec![KvEvent::AllBlocksCleared],
            0,
            0,
            0,
        ),
        (
            "non-full-attention group ignored",
            vec![KvEvent::BlockStored(sliding.clone()), sliding_removed],
            3,
            100,
            3,
        ),
        (
            "unknown parent skipped",
            vec![KvEvent::BlockStored(stored(&[301], Some(999), 49..65))],
            3,
            100,
            3,
        ),
    ];
    for (name, events, want_blocks, want_pct, want_holdings) in cases {
        let (ix, a) = setup();
        ix.apply_batch(
            a,
            &KvEventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: Some(0),
            },
        );
        let s = ix.score(&keys, &[a]);
        let got = s.get(a).map_or((0, 0), |e| {
            (e.matched_blocks, (e.score * 100.0).round() as u32)
        });
        assert_eq!(got, (want_blocks, want_pct), "{name}");
        assert_eq!(ix.holdings(a), want_holdings, "{name}");
    }
}

#[test]
fn speculative_entries_expire_or_become_real() {
    let clock = ManualClock::new(10_000);
    let ix = index_with(clock.clone(), 1 << 20);
    let (a, b) = (ep(&ix, "a"), ep(&ix, "b"));
    let toks: Vec<u32> = (1..33).collect();
    let keys = block_keys(
        &toks,
        16,
        KeyScope {
            model: M,
            cache_salt: None,
        },
    );
    ix.insert_speculative(a, &keys);
    ix.insert_speculative(b, &keys);
    assert_eq!(ix.score(&keys, &[a, b]).endpoints.len(), 2);
    // b's event confirms its blocks.
    ix.apply_event(b, &KvEvent::BlockStored(stored(&[1, 2], None, 1..33)));
    clock.advance(1_999);
    assert_eq!(
        ix.score(&keys, &[a]).get(a).map(|e| e.matched_blocks),
        Some(2),
        "still valid"
    );
    clock.advance(1);
    assert_eq!(ix.score(&keys, &[a]).get(a), None, "expired at lookup");
    assert_eq!(
        ix.score(&keys, &[b]).get(b).map(|e| e.matched_blocks),
        Some(2),
        "confirmed stays"
    );
    assert_eq!(ix.sweep_expired(), 2, "a's two speculative holdings");
    assert_eq!(ix.stats().blocks, 2);
    assert_eq!(ix.holdings(a), 0);
    assert_eq!(ix.holdings(b), 2);
}

/// A speculative insertion where the endpoint already holds the blocks: a speculative
/// holding is refreshed (its first deadline passes without expiring it or the sweep removing
/// it), a real one is left as it is (nothing to sweep), and another endpoint's holding does
/// not matter. The speculative TTL is 2 s; the insertion under test is at 11 s.
#[test]
fn speculative_insertion_over_existing_holdings() {
    let toks: Vec<u32> = (1..33).collect();
    let scope = KeyScope {
        model: M,
        cache_salt: None,
    };
    let keys = block_keys(&toks, 16, scope);
    // (name, a's holding from 10 s, b holds the blocks, swept at 13 s, a's match at 13 s)
    let cases = [
        ("nothing held", None, false, 2, None),
        ("a speculative, refreshed", Some(false), false, 2, None),
        ("a real, kept", Some(true), false, 0, Some(2)),
        ("b real", None, true, 2, None),
    ];
    for (name, a_before, b_real, want_swept, want_match) in cases {
        let clock = ManualClock::new(10_000);
        let ix = index_with(clock.clone(), 1 << 20);
        let (a, b) = (ep(&ix, "a"), ep(&ix, "b"));
        let real = || KvEvent::BlockStored(stored(&[1, 2], None, 1..33));
        match a_before {
            Some(true) => ix.apply_event(a, &real()),
            Some(false) => ix.insert_speculative(a, &keys),
            None => {}
        }
        if b_real {
            ix.apply_event(b, &real());
        }
        clock.advance(1_000);
        ix.insert_speculative(a, &keys);
        let matched = |ix: &KvIndex, id| ix.score(&keys, &[id]).get(id).map(|e| e.matched_blocks);
        clock.advance(1_500); // past a first insertion's deadline
        assert_eq!(matched(&ix, a), Some(2), "{name}: at 12.5 s");
        assert_eq!(ix.sweep_expired(), 0, "{name}: swept at 12.5 s");
        clock.advance(500);
        assert_eq!(matched(&ix, a), want_match, "{name}: at 13 s");
        assert_eq!(ix.sweep_expired(), want_swept, "{name}: swept at 13 s");
        if b_real {
            assert_eq!(matched(&ix, b), Some(2), "{name}: b");
        }
    }
}

#[test]
fn approximate_mode_lru() {
    let ix = index();
    let a = bounded_ep(&ix, "a", 4);
    let prompt = |base: u32| {
        block_keys(
            &(base..base + 32).collect::<Vec<_>>(),
            16,
            KeyScope {
                model: M,
                cache_salt: None,
            },
        )
    };
    let (p1, p2, p3) = (prompt(0), prompt(1000), prompt(2000));
    ix.record_routing(a, &p1);
    ix.record_routing(a, &p2);
    ix.record_routing(a, &p1); // touch p1: second chance
    ix.record_routing(a, &p3); // over capacity: p2 (least recently used) goes
    assert_eq!(ix.holdings(a), 4);
    let matched = |p: &BlockKeys| ix.score(p, &[a]).get(a).map_or(0, |e| e.matched_blocks);
    assert_eq!((matched(&p1), matched(&p2), matched(&p3)), (2, 0, 2));
    ix.set_capacity(a, 1);
    assert_eq!(ix.holdings(a), 1);
}

#[test]
fn dp_ranks_are_distinct_endpoints_and_removal_drops_holdings() {
    let ix = index();
    let r0 = ix.register_endpoint(EndpointSpec {
        key: EndpointKey::new("h:1", 0),
        model: M.into(),
        block_size: 16,
        capacity_blocks: None,
    });
    let r1 = ix.register_endpoint(EndpointSpec {
        key: EndpointKey::new("h:1", 1),
        model: M.into(),
        block_size: 16,
        capacity_blocks: None,
    });
    assert_ne!(r0, r1);
    assert_eq!(
        ix.register_endpoint(EndpointSpec {
            key: EndpointKey::new("h:1", 1),
            model: M.into(),
            block_size: 16,
            capacity_blocks: None
        }),
        r1
    );
    ix.apply_event(r1, &KvEvent::BlockStored(stored(&[1], None, 1..17)));
    assert_eq!((ix.holdings(r0), ix.holdings(r1)), (0, 1));
    ix.remove_endpoint(r1);
    assert_eq!(ix.stats().blocks, 0);
    assert_eq!(ix.endpoint_id(&EndpointKey::new("h:1", 1)), None);
}

/// Reference scorer: the plain per-block walk, no fingerprints.
fn naive(ix: &KvIndex, keys: &BlockKeys, cands: &[EndpointId]) -> Vec<(u32, u32, i64)> {
    let w = ix.inner.config.tier_weights;
    let mut out = Vec::new();
    for c in cands {
        let (mut blocks, mut score) = (0u32, 0.0);
        for k in &keys.keys {
            let best = ix.inner.blocks.read(k.0, |h| {
                h.iter()
                    .filter(|x| x.ep == c.0 && !x.is_expired(1_000))
                    .map(|x| w.of(x.tier))
                    .fold(None, |b: Option<f64>, x| Some(b.map_or(x, |b| b.max(x))))
            });
            match best.flatten() {
                Some(x) => {
                    blocks += 1;
                    score += x;
                }
                None => break,
            }
        }
        if blocks > 0 {
            out.push((c.0, blocks, (score * 1e6).round() as i64));
        }
    }
    out
}

#[test]
fn fingerprint_walk_equals_naive_walk() {
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for round in 0..60 {
        // Even rounds: strict walk over holdings with holes. Odd rounds: galloping over
        // prefix-closed holdings (its documented precondition).
        let exact = round % 2 == 0;
        let cfg = IndexConfig {
            gallop: !exact,
            ..IndexConfig::default()
        };
        let ix = KvIndex::with_clock(
            cfg,
            KvMetrics::unregistered(),
            Arc::new(ManualClock::new(1_000)),
        );
        let eps: Vec<EndpointId> = (0..8).map(|i| ep(&ix, &format!("e{i}"))).collect();
        let toks: Vec<u32> = (0..16 * 40).map(|i| i as u32 + round * 7).collect();
        let keys = block_keys(
            &toks,
            16,
            KeyScope {
                model: M,
                cache_salt: None,
            },
        );
        // Each endpoint holds a random prefix, with random tiers and random holes.
        for e in &eps {
            let len = (next() % 41) as usize;
            let gpu_until = (next() % 41) as usize;
            let cpu_until = gpu_until + (next() % 41) as usize;
            for (i, k) in keys.keys[..len].iter().enumerate() {
                if exact && next() % 17 == 0 {
                    continue;
                }
                // Gallop rounds: each tier prefix-closed (GPU run, then CPU, then disk), as engine
                // caches evict chain tails first.
                let tier = if exact {
                    match next() % 5 {
                        0 => Tier::Cpu,
                        1 => Tier::Disk,
                        _ => Tier::Gpu,
                    }
                } else if i < gpu_until {
                    Tier::Gpu
                } else if i < cpu_until {
                    Tier::Cpu
                } else {
                    Tier::Disk
                };
                let slot = ix.slot(*e).unwrap();
                endpoint::add_holding(&ix.inner.blocks, &slot, &mut slot.lock(), k.0, tier, None);
                if exact && i % 9 == 0 && next() % 2 == 0 {
                    endpoint::add_holding(
                        &ix.inner.blocks,
                        &slot,
                        &mut slot.lock(),
                        k.0,
                        Tier::Gpu,
                        None,
                    );
                }
            }
        }
        let cands: Vec<EndpointId> = eps.iter().copied().filter(|_| next() % 4 != 0).collect();
        let got: Vec<(u32, u32, i64)> = ix
            .score(&keys, &cands)
            .endpoints
            .iter()
            .map(|e| {
                (
                    e.endpoint.0,
                    e.matched_blocks,
                    (e.score * 40.0 * 1e6).round() as i64,
                )
            })
            .collect();
        assert_eq!(got, naive(&ix, &keys, &cands), "round {round}");
    }
}

#[test]
fn engine_hashes_follow_their_holdings_through_the_index_bound() {
    // Capacity 2; prompt 101→102 stored, then 103 (child of 102) pushes the index over its
    // bound. Tails first, so the queue's front is 102's block: it is evicted and its engine
    // hash forgotten (a child of it could not match anyway: the walk stops at 102's block).
    let chain = || KvEvent::BlockStored(stored(&[101, 102], None, 1..33));
    let child = || KvEvent::BlockStored(stored(&[103], Some(102), 33..49));
    let grandchild = || KvEvent::BlockStored(stored(&[104], Some(103), 49..65));
    let removed = |h: u64| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(h)],
            medium: Some("GPU".into()),
            ..Default::default()
        })
    };
    // (name, events, holdings after, which of 101..=104 resolve)
    type Case = (&'static str, Vec<KvEvent>, usize, [bool; 4]);
    let cases: Vec<Case> = vec![
        (
            "within the bound",
            vec![chain()],
            2,
            [true, true, false, false],
        ),
        (
            "102 evicted by the bound",
            vec![chain(), child()],
            2,
            [true, false, true, false],
        ),
        (
            "101 and 102 touched first: the new 103 goes (second chance)",
            vec![chain(), chain(), child()],
            2,
            [true, true, false, false],
        ),
        (
            "a child of a surviving hash is indexed; 101 goes",
            vec![chain(), child(), grandchild()],
            2,
            [false, false, true, true],
        ),
        (
            "removal by a forgotten hash changes nothing",
            vec![chain(), child(), removed(102)],
            2,
            [true, false, true, false],
        ),
        (
            "removal by a known hash frees room and forgets it",
            vec![chain(), child(), removed(103)],
            1,
            [true, false, false, false],
        ),
    ];
    for (name, events, want_holdings, want_resolves) in cases {
        let ix = index();
        let a = bounded_ep(&ix, "a", 2);
        for ev in &events {
            ix.apply_event(a, ev);
        }
        assert_eq!(ix.holdings(a), want_holdings, "{name}");
        let slot = ix.slot(a).unwrap();
        let st = slot.lock();
        let resolves = [101, 102, 103, 104].map(|h| st.ring.resolve(h).is_some());
        assert_eq!(resolves, want_resolves, "{name}");
    }
}

/// A hybrid engine's events as vLLM 0.32 publishes them (seen on a Gemma3-shaped model: group
/// 0 a 128-token sliding window, group 1 full attention, blocks of 16 here): the window group
/// lists only the blocks that end the prompt, decode blocks only in the full group.
#[test]
fn hybrid_groups_cut_the_hit_by_vllms_rule() {
    let full = |hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>| {
        let mut s = stored(hashes, parent, tokens);
        s.group_idx = Some(1);
        s.kv_cache_spec_kind = Some("full_attention".into());
        KvEvent::BlockStored(s)
    };
    let window = |hashes: &[u64], parent: Option<u64>, tokens: std::ops::Range<u32>| {
        let mut s = stored(hashes, parent, tokens);
        s.group_idx = Some(0);
        s.kv_cache_spec_kind = Some("sliding_window".into());
        s.kv_cache_spec_sliding_window = Some(128);
        KvEvent::BlockStored(s)
    };
    let removed = |hash: u64, group: i64| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(hash)],
            group_idx: Some(group),
            ..Default::default()
        })
    };
    // A 16-block prompt: the window group (run of ceil(127/16) = 8 blocks) keeps blocks 8-15;
    // then a decode block 16, in the full group only.
    let prefill = vec![
        window(&(108..116).collect::<Vec<_>>(), None, 0..256),
        full(&(100..116).collect::<Vec<_>>(), None, 0..256),
    ];
    let decode = vec![
        window(&[], Some(115), 256..272),
        full(&[116], Some(115), 256..272),
    ];
    let toks: Vec<u32> = (0..400).collect();
    let scope = KeyScope {
        model: M,
        cache_salt: None,
    };
    let keys = block_keys(&toks, 16, scope);
    // (name, batches, want matched blocks)
    let cases: Vec<(&str, Vec<Vec<KvEvent>>, u32)> = vec![
        (
            "plain full-attention events: the full prefix",
            vec![vec![full(&(100..116).collect::<Vec<_>>(), None, 0..256)]],
            16,
        ),
        (
            "window tail cached: the prompt's 16 blocks",
            vec![prefill.clone()],
            16,
        ),
        (
            "a decode block beyond the window tail does not extend the hit",
            vec![prefill.clone(), decode.clone()],
            16,
        ),
        (
            "a window block evicted: no run of 8 left",
            vec![prefill.clone(), vec![removed(111, 0)]],
            0,
        ),
        (
            "the full group's last block evicted: the window run no longer fits",
            vec![prefill.clone(), vec![removed(115, 1)]],
            0,
        ),
        (
            "the window group's blocks evicted, then stored again",
            vec![
                prefill.clone(),
                vec![removed(111, 0)],
                vec![window(&[111], Some(110), 176..192)],
            ],
            16,
        ),
        (
            "a window group of an unmodelled kind is skipped",
            vec![vec![
                {
                    let mut s = stored(&[108], None, 0..256);
                    s.group_idx = Some(0);
                    s.kv_cache_spec_kind = Some("chunked_local_attention".into());
                    KvEvent::BlockStored(s)
                },
                full(&(100..116).collect::<Vec<_>>(), None, 0..256),
            ]],
            16,
        ),
    ];
    for (name, batches, want) in cases {
        let ix = index();
        let a = ep(&ix, "a");
        for events in batches {
            ix.apply_batch(
                a,
                &KvEventBatch {
                    ts: 0.0,
                    events,
                    data_parallel_rank: Some(0),
                },
            );
        }
        let s = ix.score_prompt(&keys, &[a], 400);
        let got = s.get(a).map_or(0, |e| e.matched_blocks);
        assert_eq!(got, want, "{name}");
        let predicted = s.predicted_tokens_of(a);
        assert_eq!(predicted, u64::from(want) * 16, "{name}");
    }
    // What the operator's page shows for the hybrid endpoint.
    let ix = index();
    let a = ep(&ix, "a");
    ix.apply_batch(
        a,
        &KvEventBatch {
            ts: 0.0,
            events: prefill,
            data_parallel_rank: Some(0),
        },
    );
    let g = ix.cache_groups(a);
    assert_eq!(g.primary, Some(1));
    assert_eq!(
        g.others,
        vec![CacheGroup {
            group_idx: 0,
            rule: GroupRule::Run(8)
        }]
    );
    // Speculative holdings of a hybrid endpoint cover its window group too. A 256-token
    // prompt: vLLM's window tail ends at the block of token 255 (block 15), so blocks 7-14;
    // a 257-token prompt's ends at block 16, beyond the 16 full blocks: blocks 8-15.
    for (n, want) in [(256, 15), (257, 16)] {
        let ix = index();
        let b = ep(&ix, "b");
        let events = vec![window(&[], None, 0..16), full(&[900], None, 0..16)];
        let batch = KvEventBatch {
            ts: 0.0,
            events,
            data_parallel_rank: Some(0),
        };
        ix.apply_batch(b, &batch);
        let prompt = block_keys(&toks[..256], 16, scope);
        ix.insert_speculative(b, &prompt);
        ix.insert_speculative_groups(b, &prompt, n);
        let got = ix
            .score_prompt(&prompt, &[b], n)
            .get(b)
            .map(|e| e.matched_blocks);
        assert_eq!(got, Some(want), "{n} tokens");
    }
}

/// vLLM caches the same content twice when two requests compute a prefix at once, and
/// announces each copy, stored and evicted: the block stays held until its last copy goes.
#[test]
fn a_block_stored_twice_stays_held_until_both_copies_are_evicted() {
    let toks: Vec<u32> = (1..49).collect();
    let keys = block_keys(
        &toks,
        16,
        KeyScope {
            model: M,
            cache_salt: None,
        },
    );
    let store = || KvEvent::BlockStored(stored(&[101, 102, 103], None, 1..49));
    let evict = |h: u64| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(h)],
            ..Default::default()
        })
    };
    // (name, events, want matched blocks)
    let cases: Vec<(&str, Vec<KvEvent>, u32)> = vec![
        ("one copy, evicted", vec![store(), evict(103)], 2),
        (
            "two copies, one evicted",
            vec![store(), store(), evict(103)],
            3,
        ),
        (
            "two copies, both evicted",
            vec![store(), store(), evict(103), evict(103)],
            2,
        ),
        (
            "two copies, cleared",
            vec![store(), store(), KvEvent::AllBlocksCleared],
            0,
        ),
    ];
    for (name, events, want) in cases {
        let ix = index();
        let a = ep(&ix, "a");
        ix.apply_batch(
            a,
            &KvEventBatch {
                ts: 0.0,
                events,
                data_parallel_rank: Some(0),
            },
        );
        let got = ix.score(&keys, &[a]).get(a).map_or(0, |e| e.matched_blocks);
        assert_eq!(got, want, "{name}");
    }
}
