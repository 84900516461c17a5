//! The KV cache groups of the simulated model. vLLM 0.32 gives a model one KV cache group per
//! attention type (`KVCacheConfig.kv_cache_groups`): a plain model has one full-attention
//! group; a hybrid one such as Gemma3, whose layers alternate sliding-window and full
//! attention, has a sliding-window group (index 0) and a full-attention group (index 1)
//! (`--hybrid-sliding-window W`). Each group has a manager of its own
//! (`single_type_kv_cache_manager.py`); this module holds the rules in which they differ:
//!
//! - which blocks a group keeps while a request runs: a window group frees the blocks that
//!   fall out of the window (`get_num_skipped_tokens`: `computed - W + 1` tokens), leaving the
//!   null block in their place;
//! - which full blocks it caches (`reachable_block_mask` with
//!   `prefix_cache_retention_interval` 0, vLLM's default, and no EAGLE): full attention caches
//!   every block; a window group only the `N = ceil((W-1)/block_size)` blocks that end at the
//!   prompt's replay boundary, blocks `[e-N, e)` with `e = (prompt_len-1) // block_size`.
//!   vLLM also keeps the `N`-block tail ending at a shared-prefix junction it detected (a
//!   longer prefix the full-attention group holds than the window group,
//!   `shared_prefix_boundary`); the simulator does not, so on such a prompt it caches fewer
//!   window blocks than vLLM would;
//! - how a hit is found ([`window_hit`], `SlidingWindowManager.find_longest_cache_hit`).

use crate::block_pool::NULL_BLOCK;

/// The attention type of one KV cache group (its `kv_cache_spec_kind` in KV events).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GroupKind {
    /// Full attention: every block is kept and cached (`FullAttentionManager`).
    Full,
    /// Sliding-window attention over this many tokens (`SlidingWindowManager`).
    SlidingWindow(usize),
}

impl GroupKind {
    /// The groups of a model, in vLLM's order: `[Full]`, or for a hybrid model with a window
    /// of `w` tokens `[SlidingWindow(w), Full]`.
    pub(crate) fn layout(hybrid_window: Option<usize>) -> Vec<GroupKind> {
        match hybrid_window {
            Some(w) => vec![GroupKind::SlidingWindow(w), GroupKind::Full],
            None => vec![GroupKind::Full],
        }
    }

    /// `kv_cache_spec_kind` of the group's events.
    pub(crate) fn spec_kind(self) -> &'static str {
        match self {
            GroupKind::Full => "full_attention",
            GroupKind::SlidingWindow(_) => "sliding_window",
        }
    }

    /// `kv_cache_spec_sliding_window` of the group's events.
    pub(crate) fn sliding_window(self) -> Option<i64> {
        match self {
            GroupKind::Full => None,
            GroupKind::SlidingWindow(w) => i64::try_from(w).ok(),
        }
    }

    /// Consecutive cached blocks a window hit needs, `ceil((W-1)/block_size)`
    /// (`_contiguous_blocks_for_hit` without EAGLE); `None` for full attention.
    pub(crate) fn run_blocks(self, block_size: usize) -> Option<usize> {
        match self {
            GroupKind::Full => None,
            GroupKind::SlidingWindow(w) => Some(w.saturating_sub(1).div_ceil(block_size.max(1))),
        }
    }

    /// Tokens no longer attended once `computed` tokens are computed (`get_num_skipped_tokens`:
    /// `max(0, computed - W + 1)`; 0 for full attention).
    pub(crate) fn skipped_tokens(self, computed: usize) -> usize {
        match self {
            GroupKind::Full => 0,
            GroupKind::SlidingWindow(w) => computed.saturating_sub(w.saturating_sub(1)),
        }
    }

    /// Whether the group caches full block `block` of a request whose prompt has `prompt_len`
    /// tokens (`reachable_block_mask`, retention interval 0: the `N` window blocks ending at
    /// the replay boundary `(prompt_len-1) // block_size`).
    pub(crate) fn caches(self, block: usize, prompt_len: usize, block_size: usize) -> bool {
        match self.run_blocks(block_size) {
            None => true,
            Some(n) => {
                let end = prompt_len.saturating_sub(1) / block_size.max(1);
                block < end && block + n >= end
            }
        }
    }
}

/// `SlidingWindowManager.find_longest_cache_hit` over blocks `0..max`, `cached(i)` giving the
/// group's cached block for block `i`: scanning from block `max-1` down, the hit ends at the
/// end of the rightmost run of `run` consecutive cached blocks; without one, it is the run
/// of cached blocks from block 0. Returns the hit's blocks, one per hit block: the run's, with
/// [`NULL_BLOCK`] before it.
pub(crate) fn window_hit(
    max: usize,
    run: usize,
    mut cached: impl FnMut(usize) -> Option<u32>,
) -> Vec<u32> {
    let mut blocks = vec![NULL_BLOCK; max];
    let mut contiguous = 0;
    for i in (0..max).rev() {
        match cached(i) {
            Some(b) => {
                blocks[i] = b;
                contiguous += 1;
                if contiguous >= run {
                    blocks.truncate(i + contiguous);
                    return blocks;
                }
            }
            None => contiguous = 0,
        }
    }
    blocks.truncate(contiguous);
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_rules_for_w128_bs32() {
        let w = GroupKind::SlidingWindow(128);
        assert_eq!(w.run_blocks(32), Some(4));
        assert_eq!(GroupKind::Full.run_blocks(32), None);
        assert_eq!(w.spec_kind(), "sliding_window");
        assert_eq!(w.sliding_window(), Some(128));
        assert_eq!(GroupKind::Full.sliding_window(), None);
        let cases: Vec<(&str, usize, usize)> = vec![
            ("inside the window", 127, 0),
            ("one past", 128, 1),
            ("a 514-token prefill", 514, 387),
        ];
        for (name, computed, want) in cases {
            assert_eq!(w.skipped_tokens(computed), want, "{name}");
            assert_eq!(GroupKind::Full.skipped_tokens(computed), 0, "{name}");
        }
    }

    /// A 514-token prompt (16 full blocks, replay boundary block 16): the window group caches
    /// blocks 12-15 only; a prompt of exactly 16 blocks ends its run one block earlier.
    #[test]
    fn window_caches_the_run_ending_at_the_replay_boundary() {
        let w = GroupKind::SlidingWindow(128);
        let cached = |prompt_len| -> Vec<usize> {
            (0..20).filter(|&b| w.caches(b, prompt_len, 32)).collect()
        };
        assert_eq!(cached(514), vec![12, 13, 14, 15]);
        assert_eq!(
            cached(512),
            vec![11, 12, 13, 14],
            "resend capped at len - 1"
        );
        assert_eq!(
            cached(100),
            vec![0, 1, 2],
            "short: every block before the boundary"
        );
        assert_eq!(cached(32), Vec::<usize>::new());
        assert!((0..20).all(|b| GroupKind::Full.caches(b, 514, 32)));
    }

    /// Run of 4 over 10 blocks; each row flips which blocks the group holds.
    #[test]
    fn window_hit_table() {
        let cases: Vec<(&str, &[usize], usize)> = vec![
            (
                "all held: hit ends at max",
                &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
                10,
            ),
            ("rightmost run of 4", &[2, 3, 4, 5, 8, 9], 6),
            ("run at the very end", &[6, 7, 8, 9], 10),
            ("no run: the blocks from 0", &[0, 1, 5, 8, 9], 2),
            ("no run, block 0 missing", &[1, 2, 3, 8, 9], 0),
            ("nothing held", &[], 0),
        ];
        for (name, held, want) in cases {
            let hit = window_hit(10, 4, |i| held.contains(&i).then_some(100 + i as u32));
            assert_eq!(hit.len(), want, "{name}");
            for (i, &b) in hit.iter().enumerate() {
                let inside_run = want < 4 || i + 4 >= want;
                let expect = if inside_run {
                    100 + i as u32
                } else {
                    NULL_BLOCK
                };
                assert_eq!(b, expect, "{name}: block {i}");
            }
        }
    }
}
