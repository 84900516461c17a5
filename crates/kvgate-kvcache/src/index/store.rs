//! The global block map: block key → holder set, in two tables.
//!
//! Most blocks have one holder, so the main table stores one 8-byte word per block: either the
//! holding itself, packed ([`Holding::pack`]), or, for a larger set, a flag bit and the set's
//! 63-bit fingerprint. The sets themselves live in a side table (`Arc`, sorted), probed only
//! when a lookup needs a set whose fingerprint differs from the previous block's. A main entry
//! is 16 bytes where a `(key, enum)` entry was 24.
//!
//! Writers change a block only through [`BlockStore::modify`], which holds the main table's
//! entry (its bucket lock) for the whole change, so writers of one block are serialized and the
//! side table has an entry exactly when the main word says so, outside a change in progress.
//! Readers take the main word first and the set second; a reader that finds the set gone (it
//! shrank to one holding meanwhile) reads the main word again, a bounded number of times.

use std::sync::{Arc, LazyLock};

use super::BuildKeyHasher;
use super::holders::{Holders, Holding, Many, Snap};

/// Main-table flag: the holder set is in the side table; the other bits are its fingerprint.
const MANY: u64 = 1 << 63;

/// Word-then-set reads retried this often when the set vanished in between (a writer shrank
/// it to one holding); past that the block reads as unheld rather than spin.
const READ_ATTEMPTS: usize = 8;

/// Placeholder left in the side table while a writer owns the set (under both tables' locks).
static VACATED: LazyLock<Arc<Many>> = LazyLock::new(|| Arc::new(Many::default()));

/// Block key → holders (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct BlockStore {
    main: scc::HashMap<u64, u64, BuildKeyHasher>,
    many: scc::HashMap<u64, Arc<Many>, BuildKeyHasher>,
}

/// What the main word of a block says.
enum Word {
    One(Holding),
    Many(u64),
}

fn word(w: u64) -> Word {
    if w & MANY == 0 {
        Word::One(Holding::unpack(w))
    } else {
        Word::Many(w & !MANY)
    }
}

/// An emptied set counts as no set.
fn nonempty(h: Option<Holders>) -> Option<Holders> {
    h.filter(|h| !matches!(h, Holders::Many(m) if m.is_empty()))
}

/// The main word for a set, and the set the side table must hold (None when it packs).
fn encode(h: Holders) -> (u64, Option<Arc<Many>>) {
    let m = match h {
        Holders::One(h) => match h.pack() {
            Some(w) => return (w, None),
            None => Arc::new(Many::of(h)),
        },
        Holders::Many(m) => m,
    };
    (MANY | m.fp(), Some(m))
}

impl BlockStore {
    /// Distinct block keys.
    pub(crate) fn len(&self) -> usize {
        self.main.len()
    }

    /// Bytes of both tables' capacities and of the multi-holder sets (an estimate: scc's
    /// bucket metadata is counted as two bytes per entry slot).
    pub(crate) fn estimated_bytes(&self) -> usize {
        let mut bytes = (self.main.capacity() + self.many.capacity()) * (16 + 2);
        self.many.iter_sync(|_, m| {
            bytes += m.heap_bytes();
            true
        });
        bytes
    }

    /// The block's holder set, or None when no endpoint holds it.
    pub(crate) fn snapshot(&self, key: u64) -> Option<Snap> {
        for _ in 0..READ_ATTEMPTS {
            match word(self.main.read_sync(&key, |_, w| *w)?) {
                Word::One(h) => return Some(Snap::One(h)),
                Word::Many(_) => {
                    if let Some(m) = self.many.read_sync(&key, |_, m| Arc::clone(m)) {
                        return Some(Snap::Many(m));
                    }
                }
            }
        }
        None
    }

    /// The block's fingerprint (one probe), or None when no endpoint holds it.
    pub(crate) fn fingerprint(&self, key: u64) -> Option<u64> {
        self.main.read_sync(&key, |_, w| match word(*w) {
            Word::One(h) => h.mix(),
            Word::Many(fp) => fp,
        })
    }

    /// None when no endpoint holds the block; Some(None) when its fingerprint is `prev_fp`;
    /// otherwise its holder set. With `many_first` the side table is probed first: when the
    /// caller expects a new set of several holders, that is one probe where the main word and
    /// then the set would be two.
    pub(crate) fn changed(&self, key: u64, prev_fp: u64, many_first: bool) -> Option<Option<Snap>> {
        if many_first
            && let Some(r) = self
                .many
                .read_sync(&key, |_, m| (m.fp() != prev_fp).then(|| Arc::clone(m)))
        {
            return Some(r.map(Snap::Many));
        }
        for _ in 0..READ_ATTEMPTS {
            match word(self.main.read_sync(&key, |_, w| *w)?) {
                Word::One(h) => return Some((h.mix() != prev_fp).then_some(Snap::One(h))),
                Word::Many(fp) if fp == prev_fp => return Some(None),
                Word::Many(_) => {
                    if let Some(m) = self.many.read_sync(&key, |_, m| Arc::clone(m)) {
                        return Some(Some(Snap::Many(m)));
                    }
                }
            }
        }
        None
    }

    /// True when `ep` holds the block for real (at any tier): one probe for a single holder, no
    /// copy of a larger set.
    pub(crate) fn holds_real(&self, key: u64, ep: u32) -> bool {
        let real = |h: &Holding| h.ep == ep && !h.is_speculative();
        match self.main.read_sync(&key, |_, w| word(*w)) {
            None => false,
            Some(Word::One(h)) => real(&h),
            Some(Word::Many(_)) => self
                .many
                .read_sync(&key, |_, m| m.holdings().iter().any(real))
                .unwrap_or(false),
        }
    }

    /// True when `ep` holds the block, for real or speculatively and not expired at `now`.
    pub(crate) fn holds_live(&self, key: u64, ep: u32, now: u32) -> bool {
        let live = |h: &Holding| h.ep == ep && !h.is_expired(now);
        match self.main.read_sync(&key, |_, w| word(*w)) {
            None => false,
            Some(Word::One(h)) => live(&h),
            Some(Word::Many(_)) => self
                .many
                .read_sync(&key, |_, m| m.holdings().iter().any(live))
                .unwrap_or(false),
        }
    }

    /// Runs `f` on the block's holdings (sorted by endpoint, tier); None when nobody holds it.
    pub(crate) fn read<R>(&self, key: u64, f: impl FnOnce(&[Holding]) -> R) -> Option<R> {
        self.snapshot(key).map(|s| f(s.as_slice()))
    }

    /// The word-only cases of a speculative insertion of `new`: Some(true) when the block had
    /// no holder or only `new`'s endpoint's speculative holding (now `new`), Some(false) when
    /// its only holder is that endpoint for real; None when the set must be changed through
    /// [`BlockStore::modify`] (other holders, or an endpoint id that does not pack).
    pub(crate) fn put_speculative_word(&self, key: u64, new: Holding) -> Option<bool> {
        let w = new.pack()?;
        match self.main.entry_sync(key) {
            scc::hash_map::Entry::Vacant(v) => {
                v.insert_entry(w);
                Some(true)
            }
            scc::hash_map::Entry::Occupied(mut o) => match word(*o.get()) {
                Word::One(h) if h.ep == new.ep && h.is_speculative() => {
                    *o.get_mut() = w;
                    Some(true)
                }
                Word::One(h) if h.ep == new.ep => Some(false),
                _ => None,
            },
        }
    }

    /// The word-only cases of removing `ep`'s speculative GPU holding with `deadline`: Some(true)
    /// when it was the block's only holding (the block is gone), Some(false) when the block's one
    /// holding is another or the block is absent; None when it has a set of several holders.
    pub(crate) fn remove_speculative_word(&self, key: u64, ep: u32, deadline: u32) -> Option<bool> {
        match self.main.entry_sync(key) {
            scc::hash_map::Entry::Vacant(_) => Some(false),
            scc::hash_map::Entry::Occupied(o) => match word(*o.get()) {
                Word::One(h) => {
                    let ours = h.ep == ep
                        && h.is_speculative()
                        && h.tier == crate::event::Tier::Gpu as u8
                        && h.deadline == deadline;
                    if ours {
                        let _ = o.remove();
                    }
                    Some(ours)
                }
                Word::Many(_) => None,
            },
        }
    }

    /// Changes one block's holder set: `f` gets the set (None when absent) and may replace or
    /// clear it. Writers of the same block wait for each other.
    pub(crate) fn modify<R>(&self, key: u64, f: impl FnOnce(&mut Option<Holders>) -> R) -> R {
        match self.main.entry_sync(key) {
            scc::hash_map::Entry::Vacant(v) => {
                let mut cur = None;
                let r = f(&mut cur);
                if let Some(h) = nonempty(cur) {
                    let w = self.store_new(key, h);
                    v.insert_entry(w);
                }
                r
            }
            scc::hash_map::Entry::Occupied(mut o) => {
                let (mut cur, side) = match word(*o.get()) {
                    Word::One(h) => (Some(Holders::One(h)), None),
                    Word::Many(_) => match self.many.entry_sync(key) {
                        scc::hash_map::Entry::Occupied(mut side) => {
                            let set = std::mem::replace(side.get_mut(), Arc::clone(&VACATED));
                            (Some(Holders::Many(set)), Some(side))
                        }
                        // Unreachable while every change goes through here; recover as empty.
                        scc::hash_map::Entry::Vacant(_) => (None, None),
                    },
                };
                let r = f(&mut cur);
                match (nonempty(cur).map(encode), side) {
                    (None, side) => {
                        if let Some(side) = side {
                            let _ = side.remove();
                        }
                        let _ = o.remove();
                    }
                    (Some((w, Some(m))), Some(mut side)) => {
                        *side.get_mut() = m;
                        *o.get_mut() = w;
                    }
                    (Some((w, Some(m))), None) => {
                        let _ = self.many.upsert_sync(key, m);
                        *o.get_mut() = w;
                    }
                    (Some((w, None)), side) => {
                        if let Some(side) = side {
                            let _ = side.remove();
                        }
                        *o.get_mut() = w;
                    }
                }
                r
            }
        }
    }

    /// The main word for a set that has no side entry yet (inserting one when needed).
    fn store_new(&self, key: u64, h: Holders) -> u64 {
        let (w, side) = encode(h);
        if let Some(m) = side {
            let _ = self.many.upsert_sync(key, m);
        }
        w
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::Tier;

    const BIG: u32 = 1 << 30; // does not pack

    fn add(s: &BlockStore, key: u64, h: Holding) {
        s.modify(key, |cur| match cur {
            None => *cur = Some(Holders::One(h)),
            Some(set) => set.insert(h),
        });
    }

    fn remove(s: &BlockStore, key: u64, ep: u32) {
        s.modify(key, |cur| {
            if let Some(set) = cur
                && let Some(i) = set.find(ep, Tier::Gpu as u8)
                && !set.remove(i)
            {
                *cur = None;
            }
        });
    }

    /// (main entries, side entries, the holders' endpoints)
    fn state(s: &BlockStore, key: u64) -> (usize, usize, Vec<u32>) {
        let eps = s
            .read(key, |h| h.iter().map(|x| x.ep).collect())
            .unwrap_or_default();
        (s.main.len(), s.many.len(), eps)
    }

    #[test]
    fn sets_move_between_the_word_and_the_side_table() {
        // Each row: endpoints added in order, then removed in order; the state after each step.
        type Row = (
            &'static str,
            Vec<u32>,
            Vec<u32>,
            Vec<(usize, usize, Vec<u32>)>,
        );
        let rows: Vec<Row> = vec![
            (
                "one small id stays in the word",
                vec![1],
                vec![1],
                vec![(1, 0, vec![1]), (0, 0, vec![])],
            ),
            (
                "one large id goes to the side table",
                vec![BIG],
                vec![BIG],
                vec![(1, 1, vec![BIG]), (0, 0, vec![])],
            ),
            (
                "two holders, back to one small",
                vec![1, 2],
                vec![2, 1],
                vec![
                    (1, 0, vec![1]),
                    (1, 1, vec![1, 2]),
                    (1, 0, vec![1]),
                    (0, 0, vec![]),
                ],
            ),
            (
                "two holders, back to one large",
                vec![1, BIG],
                vec![1, BIG],
                vec![
                    (1, 0, vec![1]),
                    (1, 1, vec![1, BIG]),
                    (1, 1, vec![BIG]),
                    (0, 0, vec![]),
                ],
            ),
        ];
        for (name, adds, removes, want) in rows {
            let s = BlockStore::default();
            let mut got = Vec::new();
            for ep in adds {
                add(&s, 9, Holding::real(ep, Tier::Gpu));
                got.push(state(&s, 9));
            }
            for ep in removes {
                remove(&s, 9, ep);
                got.push(state(&s, 9));
            }
            assert_eq!(got, want, "{name}");
        }
    }

    #[test]
    fn speculative_word_paths_decide_or_defer() {
        let spec = |ep, d| Holding::speculative(ep, d);
        let real = |ep| Holding::real(ep, Tier::Gpu);
        // (name, holders before, what put_speculative_word(spec(1, 9)) says, holders after)
        type Put = (&'static str, Vec<Holding>, Option<bool>, Vec<Holding>);
        let puts: Vec<Put> = vec![
            ("no holder", vec![], Some(true), vec![spec(1, 9)]),
            (
                "own speculative",
                vec![spec(1, 5)],
                Some(true),
                vec![spec(1, 9)],
            ),
            ("own real", vec![real(1)], Some(false), vec![real(1)]),
            ("another endpoint", vec![real(2)], None, vec![real(2)]),
            (
                "a set",
                vec![spec(1, 5), real(2)],
                None,
                vec![spec(1, 5), real(2)],
            ),
        ];
        let filled = |before: &[Holding]| {
            let s = BlockStore::default();
            for h in before {
                add(&s, 4, *h);
            }
            s
        };
        let holders = |s: &BlockStore| s.read(4, |h| h.to_vec()).unwrap_or_default();
        for (name, before, want, after) in puts {
            let s = filled(&before);
            assert_eq!(s.put_speculative_word(4, spec(1, 9)), want, "{name}");
            assert_eq!(holders(&s), after, "{name}");
        }
        let big = BlockStore::default();
        assert_eq!(
            big.put_speculative_word(4, spec(BIG, 9)),
            None,
            "large ids defer"
        );
        assert_eq!(big.len(), 0);
        // (name, holders before, what remove_speculative_word(4, ep 1, deadline 9) says, after)
        let removes: Vec<Put> = vec![
            ("no holder", vec![], Some(false), vec![]),
            (
                "own speculative, same deadline",
                vec![spec(1, 9)],
                Some(true),
                vec![],
            ),
            (
                "own speculative, renewed",
                vec![spec(1, 10)],
                Some(false),
                vec![spec(1, 10)],
            ),
            ("own real", vec![real(1)], Some(false), vec![real(1)]),
            (
                "another endpoint",
                vec![spec(2, 9)],
                Some(false),
                vec![spec(2, 9)],
            ),
            (
                "a set",
                vec![spec(1, 9), real(2)],
                None,
                vec![spec(1, 9), real(2)],
            ),
        ];
        for (name, before, want, after) in removes {
            let s = filled(&before);
            assert_eq!(s.remove_speculative_word(4, 1, 9), want, "{name}");
            assert_eq!(holders(&s), after, "{name}");
            assert_eq!(s.len(), usize::from(!after.is_empty()), "{name}");
        }
    }

    #[test]
    fn a_word_without_its_set_reads_as_unheld_and_a_write_repairs_it() {
        let s = BlockStore::default();
        let _ = s.main.insert_sync(7, MANY | 5);
        assert!(s.snapshot(7).is_none());
        assert!(s.changed(7, 0, false).is_none());
        assert!(s.changed(7, 0, true).is_none());
        assert_eq!(s.fingerprint(7), Some(5), "the word alone still answers");
        add(&s, 7, Holding::real(3, Tier::Gpu));
        assert_eq!(state(&s, 7), (1, 0, vec![3]));
    }

    #[test]
    fn reads_agree_with_the_set() {
        let s = BlockStore::default();
        assert!(s.snapshot(5).is_none());
        assert_eq!(s.fingerprint(5), None);
        for many_first in [false, true] {
            assert!(s.changed(5, 0, many_first).is_none());
        }
        for eps in [vec![3], vec![BIG], vec![3, 4], vec![3, BIG]] {
            let s = BlockStore::default();
            for ep in &eps {
                add(&s, 5, Holding::speculative(*ep, 77));
            }
            let snap = s.snapshot(5).unwrap();
            let want = eps
                .iter()
                .fold(0, |a, ep| a ^ Holding::speculative(*ep, 77).mix());
            assert_eq!(snap.fingerprint(), want, "{eps:?}");
            let fp = s.fingerprint(5).unwrap();
            assert_eq!(fp, want, "{eps:?}");
            for many_first in [false, true] {
                assert!(
                    matches!(s.changed(5, fp, many_first), Some(None)),
                    "{eps:?} {many_first}"
                );
                let other = s.changed(5, fp ^ 1, many_first).unwrap().unwrap();
                assert_eq!(other.as_slice(), snap.as_slice(), "{eps:?} {many_first}");
            }
        }
    }

    #[test]
    fn readers_see_whole_sets_while_a_writer_reshapes_them() {
        let s = Arc::new(BlockStore::default());
        let one = [Holding::real(1, Tier::Gpu)];
        let two = [Holding::real(1, Tier::Gpu), Holding::real(2, Tier::Cpu)];
        add(&s, 1, one[0]);
        let writer = {
            let s = Arc::clone(&s);
            std::thread::spawn(move || {
                for _ in 0..20_000 {
                    add(&s, 1, Holding::real(2, Tier::Cpu));
                    s.modify(1, |cur| {
                        let set = cur.as_mut().unwrap();
                        let i = set.find(2, Tier::Cpu as u8).unwrap();
                        assert!(set.remove(i));
                    });
                }
            })
        };
        let mut reads = 0;
        while reads < 1_000 || !writer.is_finished() {
            reads += 1;
            let snap = s.snapshot(1).expect("the block is never absent");
            let list = snap.as_slice();
            assert!(list == one || list == two, "{list:?}");
            let want = list.iter().fold(0, |a, x| a ^ x.mix());
            assert_eq!(snap.fingerprint(), want);
            for many_first in [false, true] {
                if let Some(Some(changed)) = s.changed(1, want ^ 1, many_first) {
                    let list = changed.as_slice();
                    assert!(list == one || list == two, "{list:?}");
                }
            }
        }
        writer.join().unwrap();
        assert_eq!(s.read(1, |h| h.to_vec()).unwrap(), one);
    }
}
