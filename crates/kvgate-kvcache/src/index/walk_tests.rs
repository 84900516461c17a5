//! Property test of the prefix walk ([`KvIndex::score`]) against a naive per-candidate,
//! per-block reference, over random indexes: many endpoints, non-candidates, several tiers,
//! live and expired speculative holdings, staircases (the drop path), tier switches and holes
//! (the merge path).

use std::sync::Arc;

use super::*;
use crate::clock::ManualClock;
use crate::keys::{KeyScope, block_keys};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// (endpoint, matched blocks, score × 1e9 rounded), candidates with a match only.
fn naive(ix: &KvIndex, keys: &BlockKeys, cands: &[EndpointId]) -> Vec<(u32, u32, i64)> {
    let w = ix.inner.config.tier_weights;
    let now = ix.inner.clock.now_ms() as u32;
    let mut cands = cands.to_vec();
    cands.sort_unstable();
    cands.dedup();
    let mut out = Vec::new();
    for c in cands {
        let (mut blocks, mut score) = (0u32, 0.0);
        for k in &keys.keys {
            let best = ix.inner.blocks.read(k.0, |h| {
                h.iter()
                    .filter(|x| x.ep == c.0 && !x.is_expired(now))
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
            let s = score / keys.len() as f64;
            out.push((c.0, blocks, (s * 1e9).round() as i64));
        }
    }
    out
}

fn walk(ix: &KvIndex, keys: &BlockKeys, cands: &[EndpointId]) -> Vec<(u32, u32, i64)> {
    let s = ix.score(keys, cands);
    for e in &s.endpoints {
        assert_eq!(
            e.predicted_cached_tokens,
            u64::from(e.matched_blocks) * u64::from(keys.block_size)
        );
    }
    s.endpoints
        .iter()
        .map(|e| {
            (
                e.endpoint.0,
                e.matched_blocks,
                (e.score * 1e9).round() as i64,
            )
        })
        .collect()
}

#[test]
fn walk_equals_naive_on_random_indexes() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let tiers = [Tier::Gpu, Tier::Cpu, Tier::Disk];
    for round in 0..400u32 {
        // Rounds alternate: prefix-closed holdings per (endpoint, tier) under galloping, and
        // arbitrary holdings (holes, tiers appearing mid-prompt) under the strict walk.
        let closed = round % 2 == 1;
        let cfg = IndexConfig {
            gallop: closed,
            speculative_ttl: std::time::Duration::from_millis(1_000),
            ..IndexConfig::default()
        };
        let (clock, ix) = index(cfg);
        let n_eps = 1 + rng.below(40) as usize;
        let n_blocks = 1 + rng.below(64) as usize;
        let eps = register(&ix, n_eps);
        let toks: Vec<u32> = (0..4 * n_blocks as u32)
            .map(|t| t + round * 1_000)
            .collect();
        let keys = keys_of(&toks);
        // Shape: 0 random prefixes, 1 staircase (endpoint i holds ~i/n of the prompt), 2 all
        // hold everything but a few.
        let shape = rng.below(3);
        for (i, e) in eps.iter().enumerate() {
            let slot = ix.slot(*e).unwrap();
            let mut st = slot.lock();
            for tier in tiers {
                let len = match shape {
                    1 if tier == Tier::Gpu => (i + 1) * n_blocks / n_eps,
                    2 if tier == Tier::Gpu => n_blocks - rng.below(2) as usize,
                    _ if rng.below(3) == 0 => 0,
                    _ => rng.below(n_blocks as u64 + 1) as usize,
                };
                // Arbitrary rounds: a random start and holes too.
                let start = if closed { 0 } else { rng.below(3) as usize };
                for k in keys.keys.iter().take(len).skip(start) {
                    if !closed && rng.below(13) == 0 {
                        continue;
                    }
                    endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, tier, None);
                }
            }
        }
        // Speculative prefixes on some endpoints, at two times: the older ones expire.
        for at in [0u64, 700] {
            clock.set(10_000 + at);
            for e in &eps {
                if rng.below(4) == 0 {
                    let len = 1 + rng.below(n_blocks as u64) as usize;
                    let sub = BlockKeys {
                        keys: keys.keys[..len].to_vec(),
                        block_size: 4,
                    };
                    ix.insert_speculative(*e, &sub);
                }
            }
        }
        clock.set(11_200); // first batch expired (deadline 11_000), second live (11_700)
        // Most rounds score most endpoints; every third round a sparse few (the per-candidate
        // binary-search path).
        let sparse = round % 3 == 0;
        let cands: Vec<EndpointId> = eps
            .iter()
            .copied()
            .filter(|_| {
                if sparse {
                    rng.below(8) == 0
                } else {
                    rng.below(5) != 0
                }
            })
            .chain(eps.first().copied())
            .collect();
        assert_eq!(
            walk(&ix, &keys, &cands),
            naive(&ix, &keys, &cands),
            "round {round} shape {shape} closed {closed}"
        );
        // Empty candidate list and unknown prompt.
        assert!(ix.score(&keys, &[]).endpoints.is_empty());
        let other = block_keys(
            &toks,
            4,
            KeyScope {
                model: "x",
                cache_salt: None,
            },
        );
        assert!(ix.score(&other, &cands).endpoints.is_empty());
    }
}

#[test]
fn drops_found_in_sorted_sets() {
    use super::holders::Holding;
    let h = |ep| Holding::real(ep, Tier::Gpu);
    let p: Vec<Holding> = (0..20).map(h).collect();
    let fp = |s: &[Holding]| s.iter().fold(0, |a, x| a ^ x.mix());
    let mut out = Vec::new();
    let cases: Vec<Vec<usize>> = vec![
        vec![0],
        vec![19],
        vec![0, 1, 2],
        vec![3, 9, 10, 18],
        (0..19).collect(),
        vec![5],
    ];
    for drop in cases {
        let q: Vec<Holding> = (0..20)
            .filter(|i| !drop.contains(i))
            .map(|i| h(i as u32))
            .collect();
        assert!(crate::score::dropped_only(
            &p,
            &q,
            fp(&p) ^ fp(&q),
            &mut out
        ));
        assert_eq!(out, drop);
    }
    // Not a pure drop: one removed, one added; and a tier change.
    let mut q: Vec<Holding> = (1..20).map(h).collect();
    q[5] = Holding::real(5, Tier::Cpu);
    assert!(!crate::score::dropped_only(
        &p,
        &q,
        fp(&p) ^ fp(&q),
        &mut out
    ));
    let q: Vec<Holding> = (0..21).map(h).collect();
    assert!(!crate::score::dropped_only(
        &p,
        &q,
        fp(&p) ^ fp(&q),
        &mut out
    ));
}

#[test]
fn long_staircase_equals_naive() {
    // Enough drops that the walk switches to its dense candidate table; non-candidates on
    // both sides of the candidate range; a CPU prefix on every third endpoint.
    let (_clock, ix) = index(IndexConfig::default());
    let eps = register(&ix, 300);
    let toks: Vec<u32> = (0..4 * 128).collect();
    let keys = keys_of(&toks);
    for (i, e) in eps.iter().enumerate() {
        let slot = ix.slot(*e).unwrap();
        let mut st = slot.lock();
        for k in &keys.keys[..(i * 128).div_ceil(300)] {
            endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, Tier::Gpu, None);
        }
        if i % 3 == 0 {
            for k in &keys.keys[..(i * 128 / 200).min(128)] {
                endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, Tier::Cpu, None);
            }
        }
    }
    let cands: Vec<EndpointId> = eps[5..290]
        .iter()
        .copied()
        .filter(|e| e.0 % 7 != 0)
        .collect();
    let got = walk(&ix, &keys, &cands);
    assert!(got.len() > 200);
    assert_eq!(got, naive(&ix, &keys, &cands));
}

#[test]
fn shared_prefix_cut_equals_naive() {
    // Most endpoints hold a short shared prefix and a few hold more: the walk cuts the
    // candidates down to the few instead of visiting all of them. Some of the few also hold a
    // CPU copy further on, some a live speculative tail; non-candidates sit among them.
    let (_clock, ix) = index(IndexConfig::default());
    let eps = register(&ix, 300);
    let toks: Vec<u32> = (0..4 * 128).collect();
    let keys = keys_of(&toks);
    for (i, e) in eps.iter().enumerate() {
        let slot = ix.slot(*e).unwrap();
        let mut st = slot.lock();
        let gpu = match i % 61 {
            0 => 128,
            7 => 64,
            13 => 40,
            _ => 16,
        };
        // Every 61st endpoint from the 20th holds its prefix on disk only.
        let tier = if i % 61 == 20 { Tier::Disk } else { Tier::Gpu };
        for k in &keys.keys[..gpu] {
            endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, tier, None);
        }
        if i % 61 == 7 {
            for k in &keys.keys[..96] {
                endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, Tier::Cpu, None);
            }
        }
    }
    let spec = BlockKeys {
        keys: keys.keys[..80].to_vec(),
        block_size: 4,
    };
    ix.insert_speculative(eps[13], &spec);
    let cands: Vec<EndpointId> = eps.iter().copied().filter(|e| e.0 % 5 != 3).collect();
    let got = walk(&ix, &keys, &cands);
    assert_eq!(got.len(), cands.len());
    assert!(got.iter().any(|g| g.1 == 128) && got.iter().any(|g| g.1 == 96));
    assert_eq!(got, naive(&ix, &keys, &cands));
    // Unsorted, duplicated candidates give the same rows.
    let mut shuffled: Vec<EndpointId> = cands.iter().rev().copied().collect();
    shuffled.push(cands[3]);
    assert_eq!(walk(&ix, &keys, &shuffled), got);
}

#[test]
fn every_candidate_holding_block_0_once_equals_naive() {
    // Block 0's holders standing in for the candidates: the candidates are exactly block 0's
    // holders, one holding each, at all three tiers; then with two more candidates that hold
    // nothing; then with an extra candidate whose only holdings are speculative and expired
    // (back to the merge).
    let (clock, ix) = index(IndexConfig::default());
    let eps = register(&ix, 203);
    let toks: Vec<u32> = (0..4 * 64).collect();
    let keys = keys_of(&toks);
    let tiers = [Tier::Gpu, Tier::Cpu, Tier::Disk];
    for (i, e) in eps[..200].iter().enumerate() {
        let slot = ix.slot(*e).unwrap();
        let mut st = slot.lock();
        for k in &keys.keys[..1 + (i * 7) % 64] {
            endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, tiers[i % 3], None);
        }
    }
    let held = &eps[..200];
    let got = walk(&ix, &keys, held);
    assert_eq!(got.len(), 200);
    assert_eq!(got, naive(&ix, &keys, held));
    let idle: Vec<EndpointId> = eps[..200].iter().chain(&eps[201..]).copied().collect();
    assert_eq!(
        walk(&ix, &keys, &idle),
        got,
        "candidates holding nothing add no rows"
    );
    let late = eps[200];
    let spec = BlockKeys {
        keys: keys.keys[..8].to_vec(),
        block_size: 4,
    };
    ix.insert_speculative(late, &spec);
    clock.advance(5_000);
    let got = walk(&ix, &keys, &eps);
    assert_eq!(got, naive(&ix, &keys, &eps));
    assert!(got.iter().all(|g| g.0 != late.0));
}

#[test]
fn base_cut_equals_naive() {
    // Every endpoint a candidate holding block 0 once, so the walk starts from block 0's
    // holders without copying them; the first change is a cut to a few longer holders, then
    // more cuts and drops among those. Strict rounds add holders whose tier changes at the cut
    // (GPU up to the shared prefix's end, CPU after it), and one whose later blocks are only
    // speculative and expired (it dies at the cut).
    for strict in [false, true] {
        let cfg = IndexConfig {
            gallop: !strict,
            speculative_ttl: std::time::Duration::from_millis(1_000),
            ..IndexConfig::default()
        };
        let (clock, ix) = index(cfg);
        let eps = register(&ix, 250);
        let toks: Vec<u32> = (0..4 * 128).collect();
        let keys = keys_of(&toks);
        for (i, e) in eps.iter().enumerate() {
            let slot = ix.slot(*e).unwrap();
            let mut st = slot.lock();
            let (len, tier) = match i % 50 {
                0 => (128, Tier::Gpu),
                9 => (100, Tier::Disk),
                21 => (48, Tier::Cpu),
                33 => (20, Tier::Gpu),
                _ => (16, if i % 7 == 0 { Tier::Disk } else { Tier::Gpu }),
            };
            for k in &keys.keys[..len] {
                endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, tier, None);
            }
            if strict && i % 50 == 40 {
                for k in &keys.keys[16..90] {
                    endpoint::add_holding(&ix.inner.blocks, &slot, &mut st, k.0, Tier::Cpu, None);
                }
            }
        }
        if strict {
            let tail = BlockKeys {
                keys: keys.keys[16..60].to_vec(),
                block_size: 4,
            };
            ix.insert_speculative(eps[45], &tail);
            clock.advance(2_000);
        }
        let got = walk(&ix, &keys, &eps);
        assert_eq!(got.len(), eps.len(), "strict {strict}");
        assert_eq!(got, naive(&ix, &keys, &eps), "strict {strict}");
        let best = got.iter().map(|g| g.1).max();
        assert_eq!(best, Some(128), "strict {strict}");
    }
}

/// An empty index on a manual clock at 10 s.
fn index(cfg: IndexConfig) -> (ManualClock, KvIndex) {
    let clock = ManualClock::new(10_000);
    let ix = KvIndex::with_clock(cfg, KvMetrics::unregistered(), Arc::new(clock.clone()));
    (clock, ix)
}

/// The block keys of `toks` for model `m`, block size 4.
fn keys_of(toks: &[u32]) -> BlockKeys {
    block_keys(
        toks,
        4,
        KeyScope {
            model: "m",
            cache_salt: None,
        },
    )
}

/// Registers endpoints `e0`…`e{n-1}` of model `m`, block size 4.
fn register(ix: &KvIndex, n: usize) -> Vec<EndpointId> {
    (0..n)
        .map(|i| {
            ix.register_endpoint(EndpointSpec {
                key: EndpointKey::new(format!("e{i}"), 0),
                model: "m".into(),
                block_size: 4,
                capacity_blocks: None,
            })
        })
        .collect()
}

/// A lookup while an endpoint's speculative holdings are being extended over a whole prompt
/// (a parked prefix completed) sees the match before the extension or after it, never part of
/// it, galloping or not: each round a writer extends a 4-block match to 120 blocks while
/// readers walk the prompt.
#[test]
fn a_speculative_extension_is_seen_whole_or_not_at_all() {
    for gallop in [true, false] {
        let (_clock, ix) = index(IndexConfig {
            gallop,
            ..IndexConfig::default()
        });
        let ix = Arc::new(ix);
        let e = register(&ix, 2)[0];
        let prompts: Vec<BlockKeys> = (0..300u32)
            .map(|round| keys_of(&(0..480).map(|t| round * 1_000 + t).collect::<Vec<_>>()))
            .collect();
        for keys in &prompts {
            let probe = BlockKeys {
                keys: keys.keys[..4].to_vec(),
                block_size: 4,
            };
            ix.insert_speculative(e, &probe);
        }
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (ix, prompts) = (Arc::clone(&ix), prompts.clone());
                std::thread::spawn(move || {
                    let mut seen = [0usize; 2];
                    for keys in prompts.iter().cycle().take(60_000) {
                        let m = ix.score(keys, &[e]).get(e).map_or(0, |s| s.matched_blocks);
                        assert!(m == 4 || m == 120, "gallop {gallop}: matched {m} blocks");
                        seen[usize::from(m == 120)] += 1;
                    }
                    seen
                })
            })
            .collect();
        for keys in &prompts {
            ix.insert_speculative(e, keys);
        }
        for r in readers {
            let seen = r.join().expect("a reader saw part of an extension");
            assert!(
                seen[1] > 0,
                "gallop {gallop}: no reader saw an extension: {seen:?}"
            );
        }
    }
}
