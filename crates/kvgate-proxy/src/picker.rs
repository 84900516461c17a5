//! Choosing an endpoint among the candidates. Round-robin until the scheduler replaces it.

use std::{
    fmt::Debug,
    sync::{Arc, atomic::AtomicUsize, atomic::Ordering},
};

use kvgate_request::SealedRequest;

use crate::endpoint::Endpoint;

/// Picks one endpoint for a request.
pub trait Picker: Send + Sync + Debug {
    /// Called once per attempt with the healthy endpoints that serve the model and were not
    /// tried yet for this request (never empty). Returns an index into `candidates`.
    fn pick(&self, request: &SealedRequest, candidates: &[Arc<Endpoint>]) -> usize;
}

/// Cycles through the candidates.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl Picker for RoundRobin {
    fn pick(&self, _request: &SealedRequest, candidates: &[Arc<Endpoint>]) -> usize {
        self.next.fetch_add(1, Ordering::Relaxed) % candidates.len().max(1)
    }
}
