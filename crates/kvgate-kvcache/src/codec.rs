//! Event batch decoding and encoding, side by side so they cannot drift apart.
//!
//! [`decode_batch`] accepts every shape in the field (§1.11 of the protocol notes): 2- or
//! 3-element and map-shaped batches, array (vLLM ≤ 0.23) and map (≥ 0.24) events, int, signed
//! (SGLang) and `bin` hashes. [`encode_batch`] writes the exact bytes msgspec writes, so the
//! simulator publishes what vLLM publishes; the golden tests pin both directions.

mod decode;
mod encode;

pub use decode::{DecodeError, DecodeStats, decode_batch};
pub use encode::{Encoding, encode_batch, encode_batch_into};

#[cfg(test)]
mod tests;
