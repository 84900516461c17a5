//! [`HitCeiling`]: the prefix-cache hit rate a hash-block trace allows at best.
//!
//! Both oracles walk the requests in trace order and see each request's prompt as engine
//! blocks of `block_size` tokens. Block `b` covers tokens `[b·s, (b+1)·s)`; its content is
//! fixed by the chain of hash ids up to the trace block holding its last token, so its key
//! is (that chain, `b`). Chains are interned exactly, so keys never collide.
//!
//! - **Infinite cache**: a request hits the longest prefix of its blocks that some earlier
//!   request had, then all its full blocks are remembered.
//! - **Bounded LRU**: one cache of `capacity` blocks. A request hits the longest prefix of its
//!   blocks still cached, then touches all its full blocks, deepest first, so that within a
//!   chain the leaves are least recently used and are evicted before their parents.
//!
//! Hits follow vLLM's rule: the last prompt token is always computed, so at most
//! `⌊(prompt_len − 1) / s⌋` blocks hit. The hit rate is defined as the bench defines it for
//! runs ([`RunSummary::hit_rate`](crate::RunSummary::hit_rate)): cached prompt tokens over
//! prompt tokens. The oracles ignore concurrency and the blocks that generated tokens take.
//!
//! A run's hit rate only counts the requests it served (a request the engine rejected, say
//! for exceeding its context length, never entered its cache), so when a run did not serve
//! every request, [`HitCeiling::of_served`] walks exactly the requests it served; reports
//! show it as a [`ScopedCeiling`] next to the whole trace's.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::{
    BenchError, NamedRun, RequestRecord,
    workload::mooncake::{TRACE_BLOCK_TOKENS, TraceRequest},
};

/// A [`HitCeiling`] with the requests it walked, as reports show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScopedCeiling {
    /// `trace` for every selected request, or `served by NAME` for the requests run NAME
    /// served.
    pub scope: String,
    /// The ceilings.
    #[serde(flatten)]
    pub ceiling: HitCeiling,
}

/// The hit-rate ceilings of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HitCeiling {
    /// The engine block size, in tokens.
    pub block_size: usize,
    /// Requests walked.
    pub requests: usize,
    /// Sum of their prompt tokens.
    pub prompt_tokens: u64,
    /// With an infinite cache.
    pub infinite: OracleHits,
    /// With one LRU cache of a bounded number of blocks, when a capacity was given.
    pub lru: Option<OracleHits>,
}

/// One oracle's result.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct OracleHits {
    /// The cache capacity in blocks; `None` for the infinite cache.
    pub capacity_blocks: Option<usize>,
    /// Prompt tokens that hit.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` when there are no prompt tokens.
    pub hit_rate: Option<f64>,
}

impl HitCeiling {
    /// Walks `requests` in order with engine blocks of `block_size` tokens, with an
    /// infinite cache and, when `lru_blocks` is given, an LRU cache of that many blocks.
    ///
    /// # Errors
    /// [`BenchError::InvalidArgument`] for a block size of 0.
    pub fn of<'a>(
        requests: impl IntoIterator<Item = &'a TraceRequest>,
        block_size: usize,
        lru_blocks: Option<usize>,
    ) -> Result<Self, BenchError> {
        if block_size == 0 {
            return Err(BenchError::InvalidArgument(
                "oracle block size must be at least 1".into(),
            ));
        }
        let mut chains = Chains::default();
        let mut seen = HashSet::new();
        let mut lru = lru_blocks.map(Lru::new);
        let (mut prompt_tokens, mut infinite, mut bounded) = (0u64, 0u64, 0u64);
        let mut count = 0;
        for r in requests {
            count += 1;
            let keys = chains.block_keys(r, block_size);
            let cap = r.input_length.saturating_sub(1) / block_size;
            let tokens = |hits: usize| (hits.min(cap) * block_size) as u64;
            prompt_tokens += r.input_length as u64;
            infinite += tokens(keys.iter().take_while(|k| seen.contains(*k)).count());
            seen.extend(keys.iter().copied());
            if let Some(lru) = &mut lru {
                bounded += tokens(keys.iter().take_while(|k| lru.contains(**k)).count());
                for &key in keys.iter().rev() {
                    lru.touch(key);
                }
            }
        }
        let hits = |capacity_blocks, cached_tokens: u64| OracleHits {
            capacity_blocks,
            cached_tokens,
            hit_rate: (prompt_tokens > 0).then(|| cached_tokens as f64 / prompt_tokens as f64),
        };
        Ok(Self {
            block_size,
            requests: count,
            prompt_tokens,
            infinite: hits(None, infinite),
            lru: lru_blocks.map(|n| hits(Some(n), bounded)),
        })
    }

    /// The ceilings over the requests of `requests` that a run served: those whose record
    /// (matched by [`RequestRecord::index`]) succeeded and reported usage, the requests
    /// its hit rate counts.
    ///
    /// # Errors
    /// As [`Self::of`].
    pub fn of_served(
        requests: &[TraceRequest],
        records: &[RequestRecord],
        block_size: usize,
        lru_blocks: Option<usize>,
    ) -> Result<Self, BenchError> {
        let served = records
            .iter()
            .filter(|r| r.is_ok() && r.prompt_tokens.is_some())
            .filter_map(|r| requests.get(r.index));
        Self::of(served, block_size, lru_blocks)
    }

    /// A one-line description, such as `infinite cache 36.6%, LRU 16384 blocks 30.1%`.
    pub fn describe(&self) -> String {
        let pct = |h: &OracleHits| {
            h.hit_rate
                .map_or_else(|| "n/a".to_owned(), |x| format!("{:.1}%", x * 100.0))
        };
        let mut out = format!("infinite cache {}", pct(&self.infinite));
        if let Some(lru) = &self.lru {
            let n = lru.capacity_blocks.unwrap_or(0);
            out.push_str(&format!(", LRU {n} blocks {}", pct(lru)));
        }
        out
    }
}

/// For each of `runs` that did not serve every request of `trace` (see
/// [`HitCeiling::of_served`]), the ceilings over the requests it served, scoped
/// `served by NAME`.
///
/// # Errors
/// As [`HitCeiling::of`].
pub(crate) fn served_ceilings(
    trace: &[TraceRequest],
    runs: &[NamedRun],
    block_size: usize,
    lru_blocks: Option<usize>,
) -> Result<Vec<ScopedCeiling>, BenchError> {
    let mut out = Vec::new();
    for run in runs {
        let ceiling = HitCeiling::of_served(trace, &run.result.records, block_size, lru_blocks)?;
        if ceiling.requests < trace.len() {
            out.push(ScopedCeiling {
                scope: format!("served by {}", run.name),
                ceiling,
            });
        }
    }
    Ok(out)
}

/// Interns hash-id chains: (parent chain, id) → chain number.
#[derive(Debug, Default)]
struct Chains {
    ids: HashMap<(u32, u64), u32>,
}

impl Chains {
    const ROOT: u32 = u32::MAX;

    /// The keys of the full engine blocks of `r`, in order.
    fn block_keys(&mut self, r: &TraceRequest, block_size: usize) -> Vec<u64> {
        let mut parent = Self::ROOT;
        let chain: Vec<u32> = r
            .hash_ids
            .iter()
            .map(|&id| {
                let next = u32::try_from(self.ids.len()).unwrap_or(u32::MAX - 1);
                parent = *self.ids.entry((parent, id)).or_insert(next);
                parent
            })
            .collect();
        (0..r.input_length / block_size)
            .filter_map(|b| {
                let last_token = (b + 1) * block_size - 1;
                let c = chain.get(last_token / TRACE_BLOCK_TOKENS)?;
                Some((u64::from(*c) << 32) | b as u64)
            })
            .collect()
    }
}

/// An LRU set of block keys: a slab of doubly linked nodes, most recent at the head.
#[derive(Debug)]
struct Lru {
    capacity: usize,
    slots: HashMap<u64, usize>,
    nodes: Vec<Node>,
    head: usize,
    tail: usize,
}

#[derive(Debug, Clone, Copy)]
struct Node {
    key: u64,
    prev: usize,
    next: usize,
}

const NIL: usize = usize::MAX;

impl Lru {
    fn new(capacity: usize) -> Self {
        Self {
            capacity,
            slots: HashMap::with_capacity(capacity.min(1 << 20)),
            nodes: Vec::new(),
            head: NIL,
            tail: NIL,
        }
    }

    fn contains(&self, key: u64) -> bool {
        self.slots.contains_key(&key)
    }

    /// Makes `key` the most recent, inserting it (and evicting the least recent) if absent.
    fn touch(&mut self, key: u64) {
        if self.capacity == 0 {
            return;
        }
        if let Some(&i) = self.slots.get(&key) {
            self.unlink(i);
            self.push_front(i);
            return;
        }
        let i = if self.slots.len() < self.capacity {
            self.nodes.push(Node {
                key,
                prev: NIL,
                next: NIL,
            });
            self.nodes.len() - 1
        } else {
            let i = self.tail;
            self.unlink(i);
            self.slots.remove(&self.nodes[i].key);
            self.nodes[i].key = key;
            i
        };
        self.slots.insert(key, i);
        self.push_front(i);
    }

    fn unlink(&mut self, i: usize) {
        let Node { prev, next, .. } = self.nodes[i];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n].prev = prev,
        }
    }

    fn push_front(&mut self, i: usize) {
        self.nodes[i].prev = NIL;
        self.nodes[i].next = self.head;
        match self.head {
            NIL => self.tail = i,
            h => self.nodes[h].prev = i,
        }
        self.head = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(input_length: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest {
            timestamp: 0.0,
            input_length,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    /// (name, requests, block size, LRU blocks, infinite cached tokens, LRU cached tokens).
    type Case = (&'static str, Vec<TraceRequest>, usize, usize, u64, u64);

    #[test]
    fn hand_computed_ceilings() {
        let cases: Vec<Case> = vec![
            (
                // B shares A's first 2 of 3 blocks: 1024 tokens; the LRU holds all 6.
                "two of three blocks shared",
                vec![req(1536, &[1, 2, 3]), req(1536, &[1, 2, 4])],
                16,
                1000,
                1024,
                1024,
            ),
            (
                // C is exactly A's first 1024 tokens: its last token is never cached, so
                // ⌊1023/16⌋ = 63 blocks hit, not 64.
                "last token is never cached",
                vec![req(1536, &[1, 2, 3]), req(1024, &[1, 2])],
                16,
                1000,
                1008,
                1008,
            ),
            (
                // D is A's first 1100 tokens (a cut last block): 68 full blocks, all hit,
                // and ⌊1099/16⌋ = 68 allows them all.
                "cut last block shares a prefix",
                vec![req(1536, &[1, 2, 3]), req(1100, &[1, 2, 3])],
                16,
                1000,
                1088,
                1088,
            ),
            (
                // Blocks of 512. A fills the 3-block cache as [1 | 1,2 | 1,2,3] with the
                // root most recent; B's two blocks evict the leaf (1,2,3), then (1,2).
                // C then hits only block (1): 512 tokens; with no bound it hits 1024.
                "a capacity that forces eviction",
                vec![
                    req(1536, &[1, 2, 3]),
                    req(1024, &[4, 5]),
                    req(1536, &[1, 2, 6]),
                ],
                512,
                3,
                1024,
                512,
            ),
            (
                // Equal ids under different parents are different blocks.
                "an id is only shared with its prefix",
                vec![req(1024, &[1, 2]), req(1024, &[3, 2])],
                16,
                1000,
                0,
                0,
            ),
            (
                "no reuse",
                vec![req(600, &[1, 2]), req(600, &[3, 4])],
                16,
                8,
                0,
                0,
            ),
        ];
        for (name, requests, block_size, lru_blocks, want_inf, want_lru) in cases {
            let c = HitCeiling::of(&requests, block_size, Some(lru_blocks)).unwrap();
            let prompt: u64 = requests.iter().map(|r| r.input_length as u64).sum();
            assert_eq!(c.prompt_tokens, prompt, "{name}");
            assert_eq!(c.infinite.cached_tokens, want_inf, "{name}: infinite");
            let lru = c.lru.unwrap();
            assert_eq!(lru.cached_tokens, want_lru, "{name}: lru");
            assert_eq!(lru.capacity_blocks, Some(lru_blocks), "{name}");
            assert_eq!(
                c.infinite.hit_rate,
                Some(want_inf as f64 / prompt as f64),
                "{name}"
            );
        }
    }

    #[test]
    fn eviction_case_rates_and_defaults() {
        let requests = [
            req(1536, &[1, 2, 3]),
            req(1024, &[4, 5]),
            req(1536, &[1, 2, 6]),
        ];
        let c = HitCeiling::of(&requests, 512, Some(3)).unwrap();
        assert_eq!(c.infinite.hit_rate, Some(0.25));
        assert_eq!(c.lru.unwrap().hit_rate, Some(0.125));
        assert_eq!(c.describe(), "infinite cache 25.0%, LRU 3 blocks 12.5%");
        let no_lru = HitCeiling::of(&requests, 16, None).unwrap();
        assert_eq!(no_lru.lru, None);
        assert_eq!(
            HitCeiling::of(&[], 16, None).unwrap().infinite.hit_rate,
            None
        );
        let err = HitCeiling::of(&requests, 0, None)
            .map(|_| ())
            .expect_err("block size 0");
        assert_eq!(
            err.to_string(),
            "invalid argument: oracle block size must be at least 1"
        );
        let zero = HitCeiling::of(&requests, 512, Some(0)).unwrap();
        assert_eq!(zero.lru.unwrap().cached_tokens, 0);
    }

    #[test]
    fn served_ceilings_skip_failed_and_usage_less_requests() {
        let requests = [
            req(1536, &[1, 2, 3]),
            req(1536, &[1, 2, 3]),
            req(1024, &[1, 2]),
            req(1024, &[1, 2]),
        ];
        let record = |index, error, prompt| RequestRecord {
            index,
            error,
            prompt_tokens: prompt,
            ..RequestRecord::default()
        };
        // Request 0 was rejected and request 1 reported no usage: only 2 and 3 count, and
        // 3 hits 2's first ⌊1023/16⌋ = 63 blocks.
        let records = [
            record(0, Some(crate::ErrorKind::HttpStatus(400)), None),
            record(1, None, None),
            record(2, None, Some(1024)),
            record(3, None, Some(1024)),
        ];
        let c = HitCeiling::of_served(&requests, &records, 16, Some(100)).unwrap();
        assert_eq!((c.requests, c.prompt_tokens), (2, 2048));
        assert_eq!(c.infinite.cached_tokens, 1008);
        assert_eq!(c.lru.unwrap().cached_tokens, 1008);
        let all = HitCeiling::of(&requests, 16, None).unwrap();
        assert_eq!(all.infinite.cached_tokens, 1520 + 1008 + 1008);
    }

    #[test]
    fn lru_evicts_least_recent_and_touch_refreshes() {
        let mut lru = Lru::new(2);
        lru.touch(1);
        lru.touch(2);
        lru.touch(1); // 2 is now least recent
        lru.touch(3);
        assert!(lru.contains(1) && lru.contains(3) && !lru.contains(2));
        lru.touch(4);
        assert!(lru.contains(3) && lru.contains(4) && !lru.contains(1));
    }
}
