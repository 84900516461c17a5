//! msgpack KV-event batch decoder (`kvgate_kvcache::decode_batch`).
//!
//! Any bytes: decoding returns a batch or an error, never panics. A decoded batch re-encoded
//! with `encode_batch` (both wire forms) decodes to the same batch, up to what the encoder
//! cannot express: `ExtraKey::Other` goes out as a string, and the array form drops the
//! map-only fields.
#![no_main]

use kvgate_kvcache::{
    BlockRemoved, BlockStored, Encoding, ExtraKey, KvEvent, KvEventBatch, decode_batch,
    encode_batch,
};
use libfuzzer_sys::fuzz_target;

/// What survives an encode: `Other` keys become strings; the array form keeps no map-only field.
fn normalize(events: &[KvEvent], encoding: Encoding) -> Vec<KvEvent> {
    events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => {
                let mut s: BlockStored = s.clone();
                if let Some(keys) = &mut s.extra_keys {
                    for key in keys.iter_mut().flatten() {
                        for k in key.iter_mut() {
                            if let ExtraKey::Other(v) = k {
                                *k = ExtraKey::Str(std::mem::take(v));
                            }
                        }
                    }
                }
                if encoding == Encoding::Array {
                    s.locality = None;
                    s.ownership = None;
                    s.session_id = None;
                    s.lookahead_token_ids = None;
                }
                KvEvent::BlockStored(s)
            }
            KvEvent::BlockRemoved(r) => {
                let mut r: BlockRemoved = r.clone();
                if encoding == Encoding::Array {
                    r.locality = None;
                    r.ownership = None;
                }
                KvEvent::BlockRemoved(r)
            }
            KvEvent::AllBlocksCleared => KvEvent::AllBlocksCleared,
        })
        .collect()
}

fn same_ts(a: f64, b: f64) -> bool {
    a == b || (a.is_nan() && b.is_nan())
}

fuzz_target!(|data: &[u8]| {
    let Ok((batch, _stats)) = decode_batch(data) else {
        return;
    };
    for encoding in [Encoding::Map, Encoding::Array] {
        let bytes = encode_batch(batch.ts, &batch.events, batch.data_parallel_rank, encoding);
        let again: KvEventBatch = match decode_batch(&bytes) {
            Ok((b, _)) => b,
            Err(e) => panic!("re-encoded batch ({encoding:?}) does not decode: {e}"),
        };
        assert!(
            same_ts(again.ts, batch.ts),
            "ts {} != {}",
            again.ts,
            batch.ts
        );
        assert_eq!(again.data_parallel_rank, batch.data_parallel_rank);
        assert_eq!(
            again.events,
            normalize(&batch.events, encoding),
            "{encoding:?} round trip"
        );
    }
});
