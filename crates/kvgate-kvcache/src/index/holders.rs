//! The per-block holder set of the global block map ([`super::store`]).
//!
//! Most blocks are held by one endpoint, so one holding packs into the block map's 8-byte word
//! ([`Holding::pack`]); larger sets are a shared (`Arc`), sorted vector. Every set carries a
//! 63-bit fingerprint (XOR of a mix of each holding) so the scorer can tell in O(1) that the
//! next block of a prompt has exactly the same holders and tiers as the previous one.
//!
//! The scorer takes a [`Snap`] of a block (a copy of the inline holding, or a clone of the
//! `Arc`), so it can compare two blocks' sets after the map's read guard is gone; writers
//! mutate through `Arc::make_mut`, which copies the set only while a lookup still holds it.

use std::sync::Arc;

use crate::event::Tier;

/// Holding flag: inserted at routing time, not yet confirmed by an event.
pub(crate) const SPECULATIVE: u8 = 1;
/// Holding flag: touched since the endpoint's LRU clock hand last passed (second chance).
pub(crate) const REFERENCED: u8 = 2;

/// Endpoint ids below this pack into one word with their holding (larger ids, ~134 M
/// registrations in, keep working through the side table).
const PACKED_EP_LIMIT: u32 = 1 << 27;

/// One (block, endpoint, tier) holding: 12 bytes, or 63 bits packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Holding {
    pub(crate) ep: u32,
    /// Expiry (clock milliseconds, truncated to u32) of a speculative holding; 0 otherwise.
    pub(crate) deadline: u32,
    pub(crate) tier: u8,
    pub(crate) flags: u8,
}

impl Holding {
    pub(crate) fn real(ep: u32, tier: Tier) -> Self {
        Holding {
            ep,
            deadline: 0,
            tier: tier as u8,
            flags: 0,
        }
    }

    pub(crate) fn speculative(ep: u32, deadline: u32) -> Self {
        Holding {
            ep,
            deadline,
            tier: Tier::Gpu as u8,
            flags: SPECULATIVE,
        }
    }

    /// The holding in the low 63 bits of a word (endpoint 27 bits, tier 2, flags 2, deadline
    /// 32), or None when the endpoint id is too large to pack.
    pub(crate) fn pack(&self) -> Option<u64> {
        (self.ep < PACKED_EP_LIMIT).then(|| {
            u64::from(self.ep)
                | u64::from(self.tier & 3) << 27
                | u64::from(self.flags & 3) << 29
                | u64::from(self.deadline) << 31
        })
    }

    /// The inverse of [`Holding::pack`] (bit 63 is ignored).
    pub(crate) fn unpack(w: u64) -> Self {
        Holding {
            ep: (w & u64::from(PACKED_EP_LIMIT - 1)) as u32,
            tier: (w >> 27 & 3) as u8,
            flags: (w >> 29 & 3) as u8,
            deadline: (w >> 31) as u32,
        }
    }

    pub(crate) fn is_speculative(&self) -> bool {
        self.flags & SPECULATIVE != 0
    }

    /// True when a speculative holding has expired at `now` (wrapping u32 milliseconds).
    pub(crate) fn is_expired(&self, now: u32) -> bool {
        self.is_speculative() && (now.wrapping_sub(self.deadline) as i32) >= 0
    }

    /// Fingerprint contribution: identity, tier, and for speculative holdings the deadline
    /// (so two blocks with equal fingerprints also expire together). The REFERENCED bit is
    /// bookkeeping and stays out. 63 bits, so a fingerprint fits beside the block map's flag.
    pub(crate) fn mix(&self) -> u64 {
        let spec = self.is_speculative();
        let x = u64::from(self.ep)
            | (u64::from(self.tier) << 32)
            | (u64::from(spec) << 34)
            | (if spec {
                u64::from(self.deadline) << 35
            } else {
                0
            });
        // splitmix64 finalizer
        let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) >> 1
    }

    fn order(&self) -> (u32, u8) {
        (self.ep, self.tier)
    }

    /// Same identity as `other` (what the fingerprint covers): endpoint, tier, speculative
    /// flag and, for speculative holdings, the deadline. REFERENCED is ignored.
    pub(crate) fn same(&self, other: &Holding) -> bool {
        let spec = self.is_speculative();
        self.ep == other.ep
            && self.tier == other.tier
            && spec == other.is_speculative()
            && (!spec || self.deadline == other.deadline)
    }
}

/// A lookup's copy of one block's holder set (see the module docs).
#[derive(Debug, Clone)]
pub(crate) enum Snap {
    One(Holding),
    Many(Arc<Many>),
}

impl Snap {
    pub(crate) fn as_slice(&self) -> &[Holding] {
        match self {
            Snap::One(h) => std::slice::from_ref(h),
            Snap::Many(m) => &m.list,
        }
    }

    pub(crate) fn fingerprint(&self) -> u64 {
        match self {
            Snap::One(h) => h.mix(),
            Snap::Many(m) => m.fp,
        }
    }
}

/// The holders of one block key.
#[derive(Debug)]
pub(crate) enum Holders {
    One(Holding),
    Many(Arc<Many>),
}

/// A holder set in the block map's side table.
#[derive(Debug, Clone, Default)]
pub(crate) struct Many {
    fp: u64,
    /// Sorted by (endpoint, tier); at most one holding per (endpoint, tier).
    list: Vec<Holding>,
}

impl Many {
    /// The set of one holding (one that does not pack into a word).
    pub(crate) fn of(h: Holding) -> Self {
        Many {
            fp: h.mix(),
            list: vec![h],
        }
    }

    pub(crate) fn fp(&self) -> u64 {
        self.fp
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// The holdings, sorted by (endpoint, tier).
    pub(crate) fn holdings(&self) -> &[Holding] {
        &self.list
    }

    /// Heap bytes of the shared set: the `Arc` header (two counts), the set and its list.
    pub(crate) fn heap_bytes(&self) -> usize {
        16 + std::mem::size_of::<Many>() + self.list.capacity() * std::mem::size_of::<Holding>()
    }
}

impl Holders {
    #[cfg(test)]
    pub(crate) fn fingerprint(&self) -> u64 {
        match self {
            Holders::One(h) => h.mix(),
            Holders::Many(m) => m.fp,
        }
    }

    pub(crate) fn as_slice(&self) -> &[Holding] {
        match self {
            Holders::One(h) => std::slice::from_ref(h),
            Holders::Many(m) => &m.list,
        }
    }

    /// Position of the holding for (ep, tier).
    pub(crate) fn find(&self, ep: u32, tier: u8) -> Option<usize> {
        self.as_slice()
            .binary_search_by_key(&(ep, tier), Holding::order)
            .ok()
    }

    /// Positions of all holdings of `ep` (contiguous since the list is sorted).
    pub(crate) fn range_of(&self, ep: u32) -> std::ops::Range<usize> {
        let s = self.as_slice();
        let start = s.partition_point(|h| h.ep < ep);
        let end = start + s[start..].iter().take_while(|h| h.ep == ep).count();
        start..end
    }

    pub(crate) fn get(&self, i: usize) -> Option<Holding> {
        self.as_slice().get(i).copied()
    }

    /// Inserts a holding whose (ep, tier) is not present yet.
    pub(crate) fn insert(&mut self, h: Holding) {
        match self {
            Holders::One(one) => {
                let one = *one;
                let mut list = vec![one, h];
                list.sort_unstable_by_key(Holding::order);
                *self = Holders::Many(Arc::new(Many {
                    fp: one.mix() ^ h.mix(),
                    list,
                }));
            }
            Holders::Many(m) => {
                let m = Arc::make_mut(m);
                let pos = m.list.partition_point(|x| x.order() < h.order());
                m.list.insert(pos, h);
                m.fp ^= h.mix();
            }
        }
    }

    /// Replaces the holding at `i` (same endpoint and tier ordering must hold).
    pub(crate) fn set(&mut self, i: usize, h: Holding) {
        match self {
            Holders::One(one) => *one = h,
            Holders::Many(m) => {
                let m = Arc::make_mut(m);
                if let Some(slot) = m.list.get_mut(i) {
                    m.fp ^= slot.mix() ^ h.mix();
                    *slot = h;
                }
            }
        }
    }

    /// Removes the holding at `i`; returns false when the set became empty (caller removes the
    /// map entry).
    pub(crate) fn remove(&mut self, i: usize) -> bool {
        match self {
            Holders::One(_) => false,
            Holders::Many(m) => {
                let m = Arc::make_mut(m);
                if i < m.list.len() {
                    let h = m.list.remove(i);
                    m.fp ^= h.mix();
                }
                match m.list.as_slice() {
                    [] => false,
                    [only] => {
                        *self = Holders::One(*only);
                        true
                    }
                    _ => true,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_compact() {
        assert_eq!(std::mem::size_of::<Holding>(), 12);
        assert_eq!(std::mem::size_of::<Holders>(), 16);
    }

    #[test]
    fn fingerprint_tracks_set_not_order() {
        let a = Holding::real(1, Tier::Gpu);
        let b = Holding::real(2, Tier::Cpu);
        let c = Holding::speculative(3, 100);
        let mut x = Holders::One(a);
        x.insert(b);
        x.insert(c);
        let mut y = Holders::One(c);
        y.insert(b);
        y.insert(a);
        assert_eq!(x.fingerprint(), y.fingerprint());
        assert_eq!(x.as_slice(), y.as_slice(), "sorted");
        // Removing down to one gives the inline form with the same fingerprint as a fresh one.
        let i = x.find(2, Tier::Cpu as u8).unwrap();
        assert!(x.remove(i));
        let i = x.find(3, Tier::Gpu as u8).unwrap();
        assert!(x.remove(i));
        assert!(matches!(x, Holders::One(_)));
        assert_eq!(x.fingerprint(), Holders::One(a).fingerprint());
        assert!(!x.remove(0), "last holding gone");
        // Deadline matters for speculative holdings only; REFERENCED never.
        let mut touched = a;
        touched.flags |= REFERENCED;
        assert_eq!(
            Holders::One(touched).fingerprint(),
            Holders::One(a).fingerprint()
        );
        assert_ne!(
            Holders::One(Holding::speculative(3, 101)).fingerprint(),
            Holders::One(c).fingerprint()
        );
    }

    #[test]
    fn packing_round_trips_every_field() {
        let mut referenced = Holding::real(7, Tier::Disk);
        referenced.flags |= REFERENCED;
        let cases = [
            Holding::real(0, Tier::Gpu),
            Holding::real(PACKED_EP_LIMIT - 1, Tier::Cpu),
            referenced,
            Holding::speculative(5, u32::MAX),
            Holding::speculative(PACKED_EP_LIMIT - 1, 0x8000_0001),
        ];
        for h in cases {
            let w = h.pack().expect("packs");
            assert_eq!(w >> 63, 0, "{h:?} leaves the flag bit clear");
            assert_eq!(Holding::unpack(w), h);
        }
        assert_eq!(Holding::real(PACKED_EP_LIMIT, Tier::Gpu).pack(), None);
        assert_eq!(Holding::speculative(u32::MAX, 1).pack(), None);
    }

    #[test]
    fn expiry_wraps() {
        let cases = [
            (100u32, 99u32, false),
            (100, 100, true),
            (100, 101, true),
            (u32::MAX - 5, 3, true),
            (3, u32::MAX - 5, false),
        ];
        for (deadline, now, want) in cases {
            assert_eq!(
                Holding::speculative(0, deadline).is_expired(now),
                want,
                "{deadline} {now}"
            );
        }
        assert!(!Holding::real(0, Tier::Gpu).is_expired(5));
    }
}
