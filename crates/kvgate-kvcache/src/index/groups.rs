//! KV cache groups of hybrid models (vLLM's `HybridKVCacheCoordinator`).
//!
//! A hybrid model (sliding-window layers beside full-attention ones, or Mamba beside
//! attention) has one KV cache group per attention type, and vLLM publishes one `BlockStored`
//! per group, with `group_idx`, `kv_cache_spec_kind` and, for sliding windows,
//! `kv_cache_spec_sliding_window`. Block hashes are the request's own, the same in every
//! group; a sparse group lists only the blocks it caches (vLLM skips null blocks and the blocks
//! its mask says can never end a hit), so its hashes do not line up with the span's blocks.
//!
//! The index keeps the first full-attention group seen as the *primary* group: its events
//! build the router keys and the engine-hash map as for a plain model. Every other group's
//! holdings are kept under a key of their own, [`group_key`] of the primary key at the same
//! block, and named by [`group_hash`] of the engine hash; a group's hashes are resolved to
//! positions through the primary group's map (the same hash names the same block), once the
//! primary event of the same span has been applied.
//!
//! The hit (vLLM `find_longest_cache_hit`, simple hybrid: one pass): the primary group's
//! longest prefix, `F` blocks, then per other group
//! - sliding window `W` over blocks of `B` tokens: scanning blocks `F-1, F-2, …, 0` for the
//!   rightmost run of `ceil((W-1)/B)` consecutive cached blocks; the hit ends where that run
//!   ends; without such a run, the run of cached blocks from block 0
//!   (`SlidingWindowManager.find_longest_cache_hit`);
//! - Mamba (state per block): the same rule with a run of 1 (`MambaManager`: the rightmost
//!   cached block), which is all the router can know without the engine's align mode;
//! - another full-attention group: its own longest prefix.
//!
//! The prediction is the smallest of these. Linear attention (`linear_attention`, gated delta
//! nets and the like) keeps one recurrent state per request, as Mamba does: modelling it needs
//! the engine to publish the blocks at which it keeps a state, with the rule of a run of 1;
//! without that, nothing here can tell where such a group could resume. Other kinds (`chunked_local_attention`,
//! `encoder_only_attention`, `cross_attention`, …) are not modelled: their events are counted
//! as skipped (`non_full_attention_group`) and the endpoint is predicted from its primary group
//! as before. A group whose blocks are not the router's block size is skipped the same way.

use std::sync::atomic::{AtomicU64, Ordering};

/// How one non-primary group limits the hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupRule {
    /// The hit must end at the end of a run of this many consecutive cached blocks, counted
    /// back from the primary group's hit (sliding window, Mamba).
    Run(u8),
    /// The group's own longest prefix (another full-attention group).
    Prefix,
}

/// One non-primary KV cache group of an endpoint, as its events describe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGroup {
    /// vLLM's `group_idx`.
    pub group_idx: u8,
    /// How it limits a hit.
    pub rule: GroupRule,
}

/// What the index knows of an endpoint's KV cache groups (for the operator's page).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CacheGroups {
    /// The group whose events build the router keys (`None`: events name no group).
    pub primary: Option<u8>,
    /// The other groups the hit is checked against.
    pub others: Vec<CacheGroup>,
    /// Groups of kinds the index does not model, whose events are skipped.
    pub ignored: Vec<u8>,
}

/// Groups an endpoint can have besides its primary one.
const MAX_GROUPS: usize = 4;

/// An endpoint's non-primary groups packed in one word, 16 bits each (bit 15: present, bit
/// 14: prefix rule, bits 8-13: group index, bits 0-7: run length), so scoring reads them with
/// one load and no lock.
#[derive(Debug, Default)]
pub(crate) struct GroupLayout(AtomicU64);

impl GroupLayout {
    pub(crate) fn get(&self) -> Groups {
        Groups(self.0.load(Ordering::Acquire))
    }

    /// Adds or updates `g`; false when the layout is full.
    pub(crate) fn put(&self, g: CacheGroup) -> bool {
        let cur = self.get();
        let slot = cur
            .iter()
            .position(|x| x.group_idx == g.group_idx)
            .or_else(|| (cur.len() < MAX_GROUPS).then_some(cur.len()));
        let Some(i) = slot else { return false };
        let mut w = cur.0 & !(0xffff << (16 * i));
        w |= u64::from(pack(g)) << (16 * i);
        self.0.store(w, Ordering::Release);
        true
    }

    pub(crate) fn clear(&self) {
        self.0.store(0, Ordering::Release);
    }
}

fn pack(g: CacheGroup) -> u16 {
    let (prefix, run) = match g.rule {
        GroupRule::Run(n) => (0, n),
        GroupRule::Prefix => (1, 0),
    };
    0x8000 | (prefix << 14) | (u16::from(g.group_idx & 0x3f) << 8) | u16::from(run)
}

/// A snapshot of an endpoint's non-primary groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Groups(u64);

impl Groups {
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub(crate) fn len(self) -> usize {
        self.iter().count()
    }

    pub(crate) fn iter(self) -> impl Iterator<Item = CacheGroup> {
        (0..MAX_GROUPS)
            .map(move |i| (self.0 >> (16 * i)) as u16)
            .take_while(|w| w & 0x8000 != 0)
            .map(|w| CacheGroup {
                group_idx: ((w >> 8) & 0x3f) as u8,
                rule: if w & 0x4000 != 0 {
                    GroupRule::Prefix
                } else {
                    GroupRule::Run(w as u8)
                },
            })
    }

    pub(crate) fn find(self, group_idx: u8) -> Option<CacheGroup> {
        self.iter().find(|g| g.group_idx == group_idx)
    }
}

/// The rule of a non-primary group from its event's spec kind, window and block size, or
/// `None` when the index does not model it.
pub(crate) fn rule_of(kind: &str, window: Option<i64>, block_size: u32) -> Option<GroupRule> {
    match kind {
        "full_attention" | "mla_attention" | "sink_full_attention" => Some(GroupRule::Prefix),
        "sliding_window" | "sliding_window_mla" => {
            let w = u64::try_from(window?).ok().filter(|w| *w > 0)?;
            let run = (w - 1).div_ceil(u64::from(block_size.max(1))).max(1);
            u8::try_from(run).ok().map(GroupRule::Run)
        }
        "mamba" => Some(GroupRule::Run(1)),
        _ => None,
    }
}

/// The key under which group `g` holds the block whose primary key is `key`.
pub(crate) fn group_key(key: u64, g: u8) -> u64 {
    mix(key ^ (0x6a09_e667_f3bc_c908u64.wrapping_mul(u64::from(g) + 1)))
}

/// The name, in the endpoint's engine-hash map, of group `g`'s copy of engine block `hash`.
pub(crate) fn group_hash(hash: u64, g: u8) -> u64 {
    mix(hash ^ (0xbb67_ae85_84ca_a73bu64.wrapping_mul(u64::from(g) + 1)))
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// vLLM's hybrid hit in blocks: `primary` blocks held by the primary group, cut by each group
/// of `groups`, where `held(g, i)` says whether group `g` holds block `i`.
pub(crate) fn hybrid_hit(
    primary: u32,
    groups: Groups,
    mut held: impl FnMut(u8, u32) -> bool,
) -> u32 {
    let mut hit = primary;
    for g in groups.iter() {
        hit = match g.rule {
            GroupRule::Prefix => (0..hit).find(|&i| !held(g.group_idx, i)).unwrap_or(hit),
            GroupRule::Run(n) => run_hit(hit, u32::from(n), |i| held(g.group_idx, i)),
        };
        if hit == 0 {
            break;
        }
    }
    hit
}

/// `SlidingWindowManager.find_longest_cache_hit` over blocks `0..max`: the end of the
/// rightmost run of `n` held blocks, else the run held from block 0.
fn run_hit(max: u32, n: u32, mut held: impl FnMut(u32) -> bool) -> u32 {
    let mut run = 0;
    for i in (0..max).rev() {
        if held(i) {
            run += 1;
            if run >= n {
                return i + run;
            }
        } else {
            run = 0;
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_round_trips_and_updates_in_place() {
        let l = GroupLayout::default();
        assert!(l.get().is_empty());
        let sw = CacheGroup {
            group_idx: 0,
            rule: GroupRule::Run(4),
        };
        let full = CacheGroup {
            group_idx: 2,
            rule: GroupRule::Prefix,
        };
        assert!(l.put(sw));
        assert!(l.put(full));
        assert_eq!(l.get().iter().collect::<Vec<_>>(), vec![sw, full]);
        let wider = CacheGroup {
            group_idx: 0,
            rule: GroupRule::Run(8),
        };
        assert!(l.put(wider));
        assert_eq!(l.get().find(0), Some(wider));
        assert_eq!(l.get().len(), 2);
        for g in 3..5 {
            assert!(l.put(CacheGroup {
                group_idx: g,
                rule: GroupRule::Run(1)
            }));
        }
        assert!(
            !l.put(CacheGroup {
                group_idx: 9,
                rule: GroupRule::Run(1)
            }),
            "a fifth group"
        );
        l.clear();
        assert!(l.get().is_empty());
    }

    #[test]
    fn rules_from_spec_kinds() {
        let cases: [(&str, Option<i64>, u32, Option<GroupRule>); 8] = [
            ("sliding_window", Some(128), 32, Some(GroupRule::Run(4))),
            ("sliding_window", Some(129), 32, Some(GroupRule::Run(4))),
            ("sliding_window", Some(130), 32, Some(GroupRule::Run(5))),
            ("sliding_window", None, 32, None),
            (
                "sliding_window_mla",
                Some(4080),
                16,
                Some(GroupRule::Run(255)),
            ),
            ("sliding_window", Some(8192), 16, None),
            ("mamba", None, 32, Some(GroupRule::Run(1))),
            ("chunked_local_attention", Some(128), 32, None),
        ];
        for (kind, w, bs, want) in cases {
            assert_eq!(rule_of(kind, w, bs), want, "{kind} {w:?} {bs}");
        }
    }

    /// vLLM's examples and edges, one condition flipped per row: `held` lists the group's
    /// cached blocks.
    #[test]
    fn sliding_window_hit_follows_vllm() {
        let cases: [(&str, u32, u32, &[u32], u32); 8] = [
            (
                "window tail cached at the prefix end",
                16,
                4,
                &[12, 13, 14, 15],
                16,
            ),
            (
                "one tail block missing: an earlier run",
                16,
                4,
                &[8, 9, 10, 11, 13, 14, 15],
                12,
            ),
            (
                "no run of 4: the run from block 0",
                16,
                4,
                &[0, 1, 5, 6, 7],
                2,
            ),
            ("nothing cached", 16, 4, &[], 0),
            (
                "run longer than the primary hit is cut at it",
                10,
                4,
                &[4, 5, 6, 7, 8, 9, 10, 11],
                10,
            ),
            (
                "run ending after the primary hit does not count",
                10,
                4,
                &[10, 11, 12, 13],
                0,
            ),
            (
                "run of 1 (Mamba): the rightmost cached block",
                16,
                1,
                &[3, 9],
                10,
            ),
            ("everything cached from 0", 5, 4, &[0, 1, 2, 3, 4], 5),
        ];
        for (name, primary, n, held, want) in cases {
            let groups = {
                let l = GroupLayout::default();
                l.put(CacheGroup {
                    group_idx: 0,
                    rule: GroupRule::Run(n as u8),
                });
                l.get()
            };
            let got = hybrid_hit(primary, groups, |_, i| held.contains(&i));
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn every_group_cuts_the_hit() {
        let l = GroupLayout::default();
        l.put(CacheGroup {
            group_idx: 0,
            rule: GroupRule::Run(2),
        });
        l.put(CacheGroup {
            group_idx: 2,
            rule: GroupRule::Prefix,
        });
        // Group 0 allows 10 blocks (run 8, 9); group 2 holds a prefix of 6.
        let got = hybrid_hit(10, l.get(), |g, i| match g {
            0 => i == 8 || i == 9,
            _ => i < 6,
        });
        assert_eq!(got, 6);
        assert_ne!(group_key(7, 0), group_key(7, 1));
        assert_ne!(group_key(7, 0), 7);
        assert_ne!(group_hash(7, 0), group_key(7, 0));
    }
}
