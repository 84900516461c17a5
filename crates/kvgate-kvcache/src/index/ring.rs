//! An endpoint's CLOCK queue of holdings, which also resolves the engine's block hashes.
//!
//! One entry per queued holding: the router block key and, once the endpoint's events name
//! blocks, the engine hash that names it (8 or 16 bytes). A hash table of 4-byte sequence
//! numbers finds the entry an engine hash names, where a separate engine-hash → key map and
//! key queue cost 17 bytes a bucket plus 8 a key. The table
//! only ever points at entries still in the queue: popping an entry unmaps it, and a second
//! chance re-queues the mapping with the entry. Entries whose key the endpoint no longer
//! holds stay until the hand reaches them or the queue is compacted, as in a plain CLOCK
//! queue.
//!
//! A block the index evicts by its own bound takes its engine hash with it: a later removal
//! naming that hash is counted as unresolved, and a later child of it as an unknown parent
//! (whose blocks could not match anyway, since a lookup stops at the evicted block).

use std::collections::{HashSet, VecDeque};
use std::hash::Hasher;

use hashbrown::HashTable;

use super::{BuildKeyHasher, KeyHasher};

/// An entry taken off the front of the queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Popped {
    pub(crate) key: u64,
    /// The engine hash the entry carried, if the table still pointed at it.
    engine: Option<u64>,
}

/// CLOCK queue of block keys plus the engine-hash table (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Ring {
    keys: VecDeque<u64>,
    /// The engine hash carried by each queued entry, parallel to `keys` and meaningful only
    /// while the table points at the entry; empty until the first engine hash is recorded, so
    /// endpoints that never name blocks (approximate routing) pay 8 bytes an entry, not 16.
    engines: VecDeque<u64>,
    /// Sequence number of the front entry; sequence numbers wrap, the queue never holds 2^32
    /// entries.
    base: u32,
    /// Engine hash → sequence number of the entry that carries it.
    table: HashTable<u32>,
}

fn hash(engine: u64) -> u64 {
    let mut h = KeyHasher::default();
    h.write_u64(engine);
    h.finish()
}

/// The engine hash at queue position `i` (0 where none was ever recorded).
fn engine_at(engines: &VecDeque<u64>, i: usize) -> u64 {
    engines.get(i).copied().unwrap_or(0)
}

impl Ring {
    /// Queued entries, stale ones included.
    pub(crate) fn len(&self) -> usize {
        self.keys.len()
    }

    fn index(&self, seq: u32) -> usize {
        seq.wrapping_sub(self.base) as usize
    }

    fn find(&self, engine: u64) -> Option<u32> {
        let (engines, base) = (&self.engines, self.base);
        self.table
            .find(hash(engine), |&s| {
                engines.get(s.wrapping_sub(base) as usize) == Some(&engine)
            })
            .copied()
    }

    /// The block key the engine hash names.
    pub(crate) fn resolve(&self, engine: u64) -> Option<u64> {
        let seq = self.find(engine)?;
        self.keys.get(self.index(seq)).copied()
    }

    fn push(&mut self, key: u64, engine: Option<u64>) {
        let seq = self.base.wrapping_add(self.keys.len() as u32);
        if engine.is_some() && self.engines.len() != self.keys.len() {
            self.engines.resize(self.keys.len(), 0);
        }
        self.keys.push_back(key);
        if !self.engines.is_empty() || engine.is_some() {
            self.engines.push_back(engine.unwrap_or(0));
        }
        if let Some(e) = engine {
            let (engines, base) = (&self.engines, self.base);
            self.table.insert_unique(hash(e), seq, |&s| {
                hash(engine_at(engines, s.wrapping_sub(base) as usize))
            });
        }
    }

    /// Records a holding of `key`: `added` when the holding is new (it joins the queue), and
    /// `engine` when an engine hash names the key (the mapping replaces any earlier one of that
    /// hash; an entry already carrying it for this key is reused).
    pub(crate) fn record(&mut self, key: u64, added: bool, engine: Option<u64>) {
        let Some(e) = engine else {
            if added {
                self.push(key, None);
            }
            return;
        };
        if let Some(seq) = self.find(e) {
            if self.keys.get(self.index(seq)) == Some(&key) {
                return;
            }
            self.unmap_seq(e, seq);
        }
        self.push(key, Some(e));
    }

    fn unmap_seq(&mut self, engine: u64, seq: u32) {
        if let Ok(o) = self.table.find_entry(hash(engine), |&s| s == seq) {
            let _ = o.remove();
        }
    }

    /// Forgets what `engine` names, whose block the endpoint no longer holds. Its entry is
    /// dropped at once when it is at the front (engines evict in about the order blocks were
    /// queued, tails first, so removals mostly reach the front); elsewhere it stays as a stale
    /// record until the hand or a compaction reaches it.
    pub(crate) fn forget(&mut self, engine: u64) {
        let Some(seq) = self.find(engine) else { return };
        self.unmap_seq(engine, seq);
        if seq == self.base {
            self.pop_front();
        }
    }

    /// Drops the front entry: its key and engine hash (if any were recorded).
    fn pop_front(&mut self) -> Option<(u64, Option<u64>)> {
        let key = self.keys.pop_front()?;
        let engine = self.engines.pop_front();
        self.base = self.base.wrapping_add(1);
        Some((key, engine))
    }

    /// Takes the entry at the hand (the front), unmapping its engine hash.
    pub(crate) fn pop(&mut self) -> Option<Popped> {
        let seq = self.base;
        let (key, engine) = self.pop_front()?;
        let engine = engine.filter(|e| {
            self.table
                .find_entry(hash(*e), |&s| s == seq)
                .map(|o| o.remove())
                .is_ok()
        });
        Some(Popped { key, engine })
    }

    /// Queues a popped entry again at the back, with its mapping (a second chance).
    pub(crate) fn requeue(&mut self, p: Popped) {
        self.push(p.key, p.engine);
    }

    /// Every queued key, stale and duplicate ones included.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.keys.iter().copied()
    }

    /// Compacts the queue in place to the entries whose key `held` accepts, keeping the first
    /// entry of each key and every entry the table points at (their order unchanged).
    pub(crate) fn compact(&mut self, live: usize, held: impl Fn(u64) -> bool) {
        let len = self.keys.len();
        // The queue positions the table points at, found in one pass over the table.
        let mut mapped = vec![false; if self.table.is_empty() { 0 } else { len }];
        for &seq in self.table.iter() {
            if let Some(m) = mapped.get_mut(self.index(seq)) {
                *m = true;
            }
        }
        let named = !self.engines.is_empty();
        let mut seen = HashSet::with_capacity_and_hasher(live, BuildKeyHasher::default());
        let mut kept = 0;
        for i in 0..len {
            let key = self.keys[i];
            let is_mapped = mapped.get(i).copied().unwrap_or(false);
            if (seen.insert(key) || is_mapped) && held(key) {
                self.keys.swap(kept, i);
                if named {
                    self.engines.swap(kept, i);
                }
                if let Some(m) = mapped.get_mut(kept) {
                    *m = is_mapped;
                }
                kept += 1;
            }
        }
        self.keys.truncate(kept);
        self.keys.shrink_to(kept * 2);
        self.base = 0;
        mapped.truncate(kept);
        // The table keeps its allocation: the queue grows back to its size.
        self.table.clear();
        if !mapped.contains(&true) {
            self.engines = VecDeque::new();
            return;
        }
        self.engines.truncate(kept);
        self.engines.shrink_to(kept * 2);
        let engines = &self.engines;
        for (i, _) in mapped.iter().enumerate().filter(|(_, m)| **m) {
            self.table.insert_unique(hash(engines[i]), i as u32, |&s| {
                hash(engine_at(engines, s as usize))
            });
        }
    }

    /// Heap bytes of the queues and the table (one control byte per table bucket).
    pub(crate) fn heap_bytes(&self) -> usize {
        let buckets = if self.table.capacity() == 0 {
            0
        } else {
            (self.table.capacity() * 8 / 7).next_power_of_two()
        };
        (self.keys.capacity() + self.engines.capacity()) * 8 + buckets * (4 + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring_at(base: u32) -> Ring {
        Ring {
            base,
            ..Ring::default()
        }
    }

    fn drain(r: &mut Ring) -> Vec<(u64, Option<u64>)> {
        std::iter::from_fn(|| r.pop().map(|p| (p.key, p.engine))).collect()
    }

    #[test]
    fn record_maps_and_queues() {
        // (what is recorded, the queue it leaves, what engine hash 7 resolves to)
        type Row = (
            &'static str,
            Vec<(u64, bool, Option<u64>)>,
            Vec<u64>,
            Option<u64>,
        );
        let rows: Vec<Row> = vec![
            ("new holding, no hash", vec![(1, true, None)], vec![1], None),
            (
                "touched holding, no hash",
                vec![(1, false, None)],
                vec![],
                None,
            ),
            (
                "new holding named by a hash",
                vec![(1, true, Some(7))],
                vec![1],
                Some(1),
            ),
            (
                "the same hash and key again reuses the entry",
                vec![(1, true, Some(7)), (1, true, Some(7))],
                vec![1],
                Some(1),
            ),
            (
                "a touched holding newly named gets an entry",
                vec![(1, false, Some(7))],
                vec![1],
                Some(1),
            ),
            (
                "a hash naming another key moves",
                vec![(1, true, Some(7)), (2, true, Some(7))],
                vec![1, 2],
                Some(2),
            ),
            (
                "a hash 0 is a hash like any other",
                vec![(1, true, Some(0)), (2, true, Some(7))],
                vec![1, 2],
                Some(2),
            ),
        ];
        for (name, ops, queue, resolved) in rows {
            for base in [0, u32::MAX - 1] {
                let mut r = ring_at(base);
                for (key, added, engine) in ops.clone() {
                    r.record(key, added, engine);
                }
                assert_eq!(r.resolve(7), resolved, "{name} (base {base})");
                let keys: Vec<u64> = r.keys().collect();
                assert_eq!(keys, queue, "{name} (base {base})");
            }
        }
    }

    #[test]
    fn pop_unmaps_and_requeue_keeps_the_mapping() {
        let mut r = ring_at(u32::MAX);
        r.record(1, true, Some(10));
        r.record(2, true, None);
        r.record(3, true, Some(30));
        let p = r.pop().unwrap();
        assert_eq!((p.key, p.engine), (1, Some(10)));
        assert_eq!(r.resolve(10), None, "popped entries name nothing");
        r.requeue(p);
        assert_eq!(r.resolve(10), Some(1), "a second chance keeps the name");
        assert_eq!(r.resolve(30), Some(3));
        r.forget(30);
        assert_eq!(r.resolve(30), None);
        assert_eq!(
            drain(&mut r),
            vec![(2, None), (3, None), (1, Some(10))],
            "FIFO across the sequence wrap; a forgotten entry off the front stays queued"
        );
        assert_eq!(r.resolve(10), None);
    }

    #[test]
    fn unnamed_entries_cost_one_word_until_a_hash_is_recorded() {
        let mut r = Ring::default();
        for k in 1..=4 {
            r.record(k, true, None);
        }
        assert!(r.engines.is_empty());
        assert_eq!(r.heap_bytes(), r.keys.capacity() * 8);
        r.record(5, true, Some(0));
        r.record(6, true, None);
        assert_eq!(
            r.engines.len(),
            r.keys.len(),
            "parallel once a hash is recorded"
        );
        assert_eq!(
            r.resolve(0),
            Some(5),
            "hash 0 names block 5, not the unnamed entries"
        );
        assert_eq!(
            drain(&mut r),
            vec![
                (1, None),
                (2, None),
                (3, None),
                (4, None),
                (5, Some(0)),
                (6, None)
            ]
        );
        r.record(7, true, None);
        r.record(8, true, Some(80));
        r.compact(2, |k| k != 8);
        assert!(
            r.engines.is_empty(),
            "no mapping survived: back to one word"
        );
        assert_eq!(r.keys().collect::<Vec<_>>(), vec![7]);
    }

    #[test]
    fn a_forgotten_front_entry_leaves_the_queue() {
        let mut r = ring_at(u32::MAX);
        r.record(1, true, Some(10));
        r.record(2, true, Some(20));
        r.record(3, true, Some(30));
        r.forget(10);
        assert_eq!(r.keys().collect::<Vec<_>>(), vec![2, 3], "front: dropped");
        r.forget(30);
        assert_eq!(
            r.keys().collect::<Vec<_>>(),
            vec![2, 3],
            "not the front: stays"
        );
        assert_eq!((r.resolve(20), r.resolve(30)), (Some(2), None));
        r.forget(20);
        assert_eq!(r.keys().collect::<Vec<_>>(), vec![3]);
        assert_eq!(drain(&mut r), vec![(3, None)]);
        r.forget(99);
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn many_mappings_survive_table_growth() {
        let mut r = Ring::default();
        for k in 0..5_000u64 {
            r.record(k, true, Some(k * 31 + 5));
        }
        for k in 0..5_000u64 {
            assert_eq!(r.resolve(k * 31 + 5), Some(k), "{k}");
        }
        for _ in 0..2_500 {
            let p = r.pop().unwrap();
            r.requeue(p);
        }
        for k in 0..5_000u64 {
            assert_eq!(r.resolve(k * 31 + 5), Some(k), "{k} after requeues");
        }
    }

    #[test]
    fn compaction_keeps_held_keys_once_and_every_mapping() {
        let mut r = ring_at(u32::MAX - 3);
        r.record(1, true, None);
        r.record(2, true, Some(20));
        r.record(1, true, None); // duplicate, unnamed: dropped
        r.record(3, true, None); // no longer held: dropped
        r.record(2, false, Some(21)); // duplicate, named: kept
        r.record(4, true, Some(40)); // named but no longer held: dropped
        r.compact(2, |k| k != 3 && k != 4);
        assert_eq!(r.keys().collect::<Vec<_>>(), vec![1, 2, 2]);
        assert_eq!(r.resolve(20), Some(2));
        assert_eq!(r.resolve(21), Some(2));
        assert_eq!(r.resolve(40), None);
        assert_eq!(drain(&mut r), vec![(1, None), (2, Some(20)), (2, Some(21))]);
    }
}
