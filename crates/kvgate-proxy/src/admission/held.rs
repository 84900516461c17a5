//! [`HeldBody`]: a response body that holds a request's flow-control slots until it ends.

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use http_body::{Body, Frame, SizeHint};

use super::{EndpointSlot, Permit};

/// A request's flow-control slots: its [`Permit`] and its [`EndpointSlot`] (each may be
/// absent). Dropping it releases both.
#[derive(Debug, Default)]
pub struct Held {
    /// The global slot.
    pub permit: Option<Permit>,
    /// The slot on the endpoint serving the request.
    pub slot: Option<EndpointSlot>,
}

impl Held {
    /// Whether it holds nothing (flow control off).
    pub fn is_empty(&self) -> bool {
        self.permit.is_none() && self.slot.is_none()
    }
}

/// A body passed through unchanged that releases its [`Held`] slots when it ends (last
/// frame, error) or is dropped (client gone).
#[derive(Debug)]
pub struct HeldBody<B> {
    inner: Pin<Box<B>>,
    held: Option<Held>,
}

impl<B> HeldBody<B> {
    /// Wraps `inner`, holding `held` until it ends.
    pub fn new(inner: B, held: Held) -> Self {
        Self {
            inner: Box::pin(inner),
            held: Some(held),
        }
    }
}

impl<B: Body> Body for HeldBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let polled = self.inner.as_mut().poll_frame(cx);
        match &polled {
            Poll::Ready(None | Some(Err(_))) => self.held = None,
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => self.held = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
