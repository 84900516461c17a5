//! An engine's response body, whichever client brought it: kvgate's own pool (plain
//! `http://` endpoints) or hyper (`https://` endpoints and dedicated upload connections).

use std::{
    pin::Pin,
    task::{Context, Poll},
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;

use super::PooledBody;
use crate::body::BoxError;

/// An engine's response body (see the module docs).
#[derive(Debug)]
pub(crate) struct UpstreamBody(Source);

#[derive(Debug)]
enum Source {
    Pooled(PooledBody),
    Hyper(Incoming),
}

impl From<PooledBody> for UpstreamBody {
    fn from(body: PooledBody) -> Self {
        UpstreamBody(Source::Pooled(body))
    }
}

impl From<Incoming> for UpstreamBody {
    fn from(body: Incoming) -> Self {
        UpstreamBody(Source::Hyper(body))
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().0 {
            Source::Pooled(body) => Pin::new(body).poll_frame(cx).map_err(BoxError::from),
            Source::Hyper(body) => Pin::new(body).poll_frame(cx).map_err(BoxError::from),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.0 {
            Source::Pooled(body) => body.is_end_stream(),
            Source::Hyper(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.0 {
            Source::Pooled(body) => body.size_hint(),
            Source::Hyper(body) => body.size_hint(),
        }
    }
}
