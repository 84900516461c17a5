//! One ext_proc stream, Envoy's side: messages in, the EPP's answers out.

use std::time::Duration;

use envoy_types::pb::envoy::{
    config::core::v3::{HeaderMap, HeaderValue},
    service::ext_proc::v3::{
        ProcessingRequest, ProcessingResponse, external_processor_client::ExternalProcessorClient,
    },
};
use tokio::sync::mpsc;
use tonic::Streaming;

use super::Epp;

/// One ext_proc stream to an [`Epp`].
pub struct Conv {
    pub tx: mpsc::Sender<ProcessingRequest>,
    pub rx: Streaming<ProcessingResponse>,
}

impl Conv {
    /// Opens a stream to `epp`.
    pub async fn open(epp: &Epp) -> Conv {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.addr))
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel::<ProcessingRequest>(16);
        let out =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
            );
        let rx = client.process(out).await.unwrap().into_inner();
        Conv { tx, rx }
    }

    /// Sends one message.
    pub async fn send(&self, msg: ProcessingRequest) {
        self.tx.send(msg).await.unwrap();
    }

    /// The next answer (fails the test after 10 s or when the stream closed).
    pub async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("no answer within 10 s")
            .unwrap()
            .expect("stream closed")
    }
}

/// Envoy's header map of `list` (values as raw bytes, as Envoy sends them).
pub fn header_map(list: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: list
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).to_owned(),
                raw_value: v.as_bytes().to_vec(),
                ..HeaderValue::default()
            })
            .collect(),
    }
}
