//! `kvgate_requests_total`'s counters, remembered by each thread.
//!
//! The family finds a label set's counter under its lock, through a map keyed by SipHash: about
//! 500 instructions a request on the proxy path. Each thread keeps the counters it has used in
//! a map of its own, keyed by a cheaper hash and found without building the labels.
//!
//! A remembered counter stays the one the family exports because nothing removes a label set
//! from this family; code that ever does must clear the threads' maps as well.

use std::{
    cell::RefCell,
    sync::atomic::{AtomicU64, Ordering},
};

use hashbrown::{Equivalent, HashMap};
use prometheus_client::metrics::{counter::Counter, family::Family};

use super::RequestLabels;

/// Counters remembered by one thread, at most; past that it forgets them all and starts again
/// (endpoints come and go).
const REMEMBERED: usize = 1024;

/// Tells one metrics instance from another (tests make many; an address could be reused).
static NEXT_FAMILY: AtomicU64 = AtomicU64::new(0);

/// A label set, owned, and which family it belongs to.
#[derive(Hash, PartialEq, Eq)]
struct Key {
    family: u64,
    api: &'static str,
    status: u16,
    endpoint: Box<str>,
}

/// The same, borrowed: hashes as [`Key`] does.
#[derive(Hash)]
struct KeyRef<'a> {
    family: u64,
    api: &'static str,
    status: u16,
    endpoint: &'a str,
}

impl Equivalent<Key> for KeyRef<'_> {
    fn equivalent(&self, key: &Key) -> bool {
        self.family == key.family
            && self.api == key.api
            && self.status == key.status
            && self.endpoint == &*key.endpoint
    }
}

thread_local! {
    static REMEMBERED_COUNTERS: RefCell<HashMap<Key, Counter, foldhash::fast::RandomState>> =
        RefCell::new(HashMap::default());
}

/// `kvgate_requests_total{api,status,endpoint}`, counted through each thread's memory of it.
/// A clone counts into the same family.
#[derive(Debug, Clone)]
pub struct RequestCounters {
    family: Family<RequestLabels, Counter>,
    id: u64,
}

impl RequestCounters {
    /// Counts through `family`.
    pub fn new(family: Family<RequestLabels, Counter>) -> Self {
        Self {
            family,
            id: NEXT_FAMILY.fetch_add(1, Ordering::Relaxed),
        }
    }

    /// The family itself (to register it).
    pub fn family(&self) -> &Family<RequestLabels, Counter> {
        &self.family
    }

    /// Counts one request.
    pub fn inc(&self, api: &'static str, status: u16, endpoint: &str) {
        let key = KeyRef {
            family: self.id,
            api,
            status,
            endpoint,
        };
        REMEMBERED_COUNTERS.with_borrow_mut(|counters| {
            if let Some(counter) = counters.get(&key) {
                counter.inc();
                return;
            }
            let counter = self
                .family
                .get_or_create(&RequestLabels {
                    api,
                    status,
                    endpoint: endpoint.to_owned(),
                })
                .clone();
            counter.inc();
            if counters.len() >= REMEMBERED {
                counters.clear();
            }
            counters.insert(
                Key {
                    family: self.id,
                    api,
                    status,
                    endpoint: endpoint.into(),
                },
                counter,
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::{encoding::text::encode, registry::Registry};

    use super::*;

    /// One request counted: api, status, endpoint.
    type Count = (&'static str, u16, &'static str);
    /// A line wanted: api, status, endpoint, count.
    type Counted = (&'static str, u16, &'static str, u64);

    /// The family's text after `counts` through a fresh instance.
    fn counted(counts: &[(&'static str, u16, &str)]) -> String {
        let counters = RequestCounters::new(Family::default());
        let mut registry = Registry::default();
        registry.register("requests", "", counters.family().clone());
        for (api, status, endpoint) in counts {
            counters.inc(api, *status, endpoint);
        }
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        text
    }

    fn line(api: &str, status: u16, endpoint: &str, n: u64) -> String {
        format!("requests_total{{api=\"{api}\",status=\"{status}\",endpoint=\"{endpoint}\"}} {n}\n")
    }

    /// One condition a row: each count lands on its own label set.
    #[test]
    fn each_label_set_counts_apart() {
        let rows: [(&str, &[Count], &[Counted]); 5] = [
            ("once", &[("chat", 200, "a:1")], &[("chat", 200, "a:1", 1)]),
            (
                "twice, the second remembered",
                &[("chat", 200, "a:1"), ("chat", 200, "a:1")],
                &[("chat", 200, "a:1", 2)],
            ),
            (
                "another endpoint",
                &[("chat", 200, "a:1"), ("chat", 200, "a:2")],
                &[("chat", 200, "a:1", 1), ("chat", 200, "a:2", 1)],
            ),
            (
                "another status",
                &[("chat", 200, "a:1"), ("chat", 503, "a:1")],
                &[("chat", 200, "a:1", 1), ("chat", 503, "a:1", 1)],
            ),
            (
                "another api",
                &[("chat", 200, "a:1"), ("completions", 200, "a:1")],
                &[("chat", 200, "a:1", 1), ("completions", 200, "a:1", 1)],
            ),
        ];
        for (name, counts, want) in rows {
            let text = counted(counts);
            for (api, status, endpoint, n) in want {
                assert!(
                    text.contains(&line(api, *status, endpoint, *n)),
                    "{name}: {text}"
                );
            }
            let lines = text
                .lines()
                .filter(|l| l.starts_with("requests_total"))
                .count();
            assert_eq!(lines, want.len(), "{name}: {text}");
        }
    }

    /// Two instances on one thread keep their own counts, and a thread that has forgotten
    /// its counters (past the cap) still counts into the same ones.
    #[test]
    fn instances_and_the_cap_do_not_lose_counts() {
        let first = counted(&[("chat", 200, "a:1")]);
        let second = counted(&[("chat", 200, "a:1")]);
        assert!(first.contains(&line("chat", 200, "a:1", 1)), "{first}");
        assert!(second.contains(&line("chat", 200, "a:1", 1)), "{second}");

        let endpoints: Vec<String> = (0..REMEMBERED + 10).map(|i| format!("e:{i}")).collect();
        let mut counts: Vec<(&'static str, u16, &str)> = endpoints
            .iter()
            .map(|e| ("chat", 200, e.as_str()))
            .collect();
        counts.extend([("chat", 200, "e:0"), ("chat", 200, "e:1030")]);
        let text = counted(&counts);
        assert!(text.contains(&line("chat", 200, "e:0", 2)), "e:0");
        assert!(text.contains(&line("chat", 200, "e:1030", 2)), "e:1030");
        assert!(text.contains(&line("chat", 200, "e:5", 1)), "e:5");
    }
}
