//! Exact request bytes plus a parsed view of the inference APIs; model splice; sealing.
