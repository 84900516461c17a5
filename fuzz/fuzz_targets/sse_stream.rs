//! SSE framing and the response-side stream readers (`kvgate-request`): `SseEvents`, the
//! proxy's `SseUsageObserver` and `SseModelRewriter`.
//!
//! Input: byte 0 picks the event-size cap, byte 1 seeds the chunk sizes, the rest is the
//! stream. Checked: the splitter's pieces are the stream byte for byte, and the events, the
//! oversize count, the usage seen and the rewritten output do not depend on the chunking.
#![no_main]

use kvgate_request::{
    DEFAULT_MAX_EVENT_BYTES, SseEvents, SseModelRewriter, SsePiece, SseUsageObserver,
};
use libfuzzer_sys::fuzz_target;

/// Splits `stream` into chunks of 0..=23 bytes drawn from `seed` (empty chunks included).
fn chunks(stream: &[u8], seed: u8) -> Vec<&[u8]> {
    let mut state = u32::from(seed).wrapping_mul(2_654_435_761).wrapping_add(1);
    let mut out = Vec::new();
    let mut rest = stream;
    while !rest.is_empty() {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        let n = ((state >> 16) % 24) as usize;
        let (head, tail) = rest.split_at(n.min(rest.len()));
        out.push(head);
        rest = tail;
    }
    out
}

/// Runs the splitter: (concatenated pieces, complete events, oversize count, clean end).
fn split(parts: &[&[u8]], cap: usize) -> (Vec<u8>, Vec<Vec<u8>>, u64, bool) {
    let mut splitter = SseEvents::with_max_event_bytes(cap);
    let mut all = Vec::new();
    let mut events = Vec::new();
    let mut on_piece = |piece: SsePiece<'_>| match piece {
        SsePiece::Event(e) => {
            all.extend_from_slice(e);
            events.push(e.to_vec());
        }
        SsePiece::Unread(b) => all.extend_from_slice(b),
    };
    for part in parts {
        splitter.push(part, &mut on_piece);
        assert!(splitter.held_bytes() <= cap, "held more than the cap");
    }
    let clean = splitter.finish(&mut on_piece);
    (all, events, splitter.oversize_events(), clean)
}

fn rewrite(parts: &[&[u8]], cap: usize) -> (Vec<u8>, u64) {
    let mut rewriter = SseModelRewriter::with_max_event_bytes("client-model", cap);
    let mut out = Vec::new();
    for part in parts {
        out.extend_from_slice(&rewriter.push(part));
    }
    out.extend_from_slice(&rewriter.finish());
    (out, rewriter.oversize_events())
}

fn observe(parts: &[&[u8]], cap: usize) -> (Option<kvgate_request::Usage>, u64) {
    let mut observer = SseUsageObserver::with_max_event_bytes(cap);
    for part in parts {
        observer.observe(part);
    }
    (observer.usage(), observer.oversize_events())
}

fuzz_target!(|data: &[u8]| {
    let [cap_sel, seed, stream @ ..] = data else {
        return;
    };
    let cap = if cap_sel & 0x80 != 0 {
        DEFAULT_MAX_EVENT_BYTES
    } else {
        usize::from(cap_sel & 0x7f) * 3 + 1
    };
    let whole = [stream];
    let parts = chunks(stream, *seed);

    let one = split(&whole, cap);
    let many = split(&parts, cap);
    assert_eq!(one.0, stream, "pieces are not the stream (one chunk)");
    assert_eq!(many.0, stream, "pieces are not the stream (chunked)");
    assert_eq!(one.1, many.1, "events depend on the chunking");
    assert_eq!(one.2, many.2, "oversize count depends on the chunking");
    assert_eq!(one.3, many.3, "clean end depends on the chunking");

    assert_eq!(
        observe(&whole, cap),
        observe(&parts, cap),
        "usage depends on the chunking"
    );
    assert_eq!(
        rewrite(&whole, cap),
        rewrite(&parts, cap),
        "rewrite depends on the chunking"
    );
});
