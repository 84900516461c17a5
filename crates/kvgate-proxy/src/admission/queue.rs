//! The flow-control queue's order, without locks, channels or clocks: priority bands
//! (highest first), round-robin between fairness ids within a band, FIFO within an id.
//!
//! Generic over the queued item so its order is tested on plain values (`tests.rs`); the
//! controller (`super`) queues its waiters in it.

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    sync::Arc,
};

/// One queued item and its id (ids grow with arrival, so a larger id is newer).
#[derive(Debug)]
struct Entry<T> {
    id: u64,
    item: T,
}

/// One priority's flows: the fairness ids with queued items, in turn order, and their items.
#[derive(Debug)]
struct Band<T> {
    /// Fairness ids with at least one item; the front one is served next.
    ring: VecDeque<Arc<str>>,
    flows: HashMap<Arc<str>, VecDeque<Entry<T>>>,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Self {
            ring: VecDeque::new(),
            flows: HashMap::new(),
        }
    }
}

/// Queued items by priority and fairness id. See the module docs for the order.
#[derive(Debug)]
pub(crate) struct Queue<T> {
    bands: BTreeMap<i32, Band<T>>,
    /// Where each queued id is: its priority and fairness id.
    index: HashMap<u64, (i32, Arc<str>)>,
    next_id: u64,
}

impl<T> Default for Queue<T> {
    fn default() -> Self {
        Self {
            bands: BTreeMap::new(),
            index: HashMap::new(),
            next_id: 0,
        }
    }
}

impl<T> Queue<T> {
    /// How many items are queued.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether nothing is queued.
    pub(crate) fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Queues `item` at the back of its fairness id's line in its priority band; its id.
    pub(crate) fn push(&mut self, priority: i32, fairness: &Arc<str>, item: T) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let band = self.bands.entry(priority).or_default();
        let flow = band.flows.entry(fairness.clone()).or_insert_with(|| {
            band.ring.push_back(fairness.clone());
            VecDeque::new()
        });
        flow.push_back(Entry { id, item });
        self.index.insert(id, (priority, fairness.clone()));
        id
    }

    /// Takes the first item, in queue order, that `eligible` accepts: the highest priority
    /// band first; in a band, the fairness ids in turn (the id served moves to the back of
    /// the turn order), and each id's items oldest first. Items `eligible` rejects stay
    /// where they are (with only a global limit every item is eligible or none is).
    pub(crate) fn pop_first(&mut self, mut eligible: impl FnMut(&T) -> bool) -> Option<T> {
        let mut found: Option<(i32, usize, usize)> = None;
        'bands: for (&priority, band) in self.bands.iter().rev() {
            for (turn, fid) in band.ring.iter().enumerate() {
                let Some(flow) = band.flows.get(fid) else {
                    continue;
                };
                if let Some(pos) = flow.iter().position(|e| eligible(&e.item)) {
                    found = Some((priority, turn, pos));
                    break 'bands;
                }
            }
        }
        let (priority, turn, pos) = found?;
        let band = self.bands.get_mut(&priority)?;
        let fid = band.ring.remove(turn)?;
        let flow = band.flows.get_mut(&fid)?;
        let entry = flow.remove(pos)?;
        if flow.is_empty() {
            band.flows.remove(&fid);
        } else {
            band.ring.push_back(fid);
        }
        if band.ring.is_empty() {
            self.bands.remove(&priority);
        }
        self.index.remove(&entry.id);
        Some(entry.item)
    }

    /// Removes the item with this id (a waiter that gave up); `None` when it is not queued
    /// (already taken).
    pub(crate) fn remove(&mut self, id: u64) -> Option<T> {
        let (priority, fid) = self.index.remove(&id)?;
        let band = self.bands.get_mut(&priority)?;
        let flow = band.flows.get_mut(&fid)?;
        let pos = flow.iter().position(|e| e.id == id)?;
        let entry = flow.remove(pos)?;
        if flow.is_empty() {
            band.flows.remove(&fid);
            band.ring.retain(|f| *f != fid);
        }
        if band.ring.is_empty() {
            self.bands.remove(&priority);
        }
        Some(entry.item)
    }

    /// The item to shed when the queue is full: the lowest priority's newest item, as
    /// `(priority, id)`.
    pub(crate) fn shed_candidate(&self) -> Option<(i32, u64)> {
        let (&priority, band) = self.bands.iter().next()?;
        let newest = band
            .flows
            .values()
            .filter_map(|f| f.back().map(|e| e.id))
            .max()?;
        Some((priority, newest))
    }
}
