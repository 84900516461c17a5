//! KV events lost while the router's connection to a real engine's publisher is cut are
//! replayed from the engine's replay socket once the connection is back.

use std::{
    io::{Read, Write},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use super::*;

/// A TCP relay in front of the engine's event publisher that can be cut: every connection
/// closed, and new ones held open without a byte through (a partition, not a refusal: the
/// router's reconnect waits instead of spinning), until it is restored.
struct Cuttable {
    addr: SocketAddr,
    open: Arc<AtomicBool>,
    live: Arc<Mutex<Vec<TcpStream>>>,
    held: Arc<Mutex<Vec<TcpStream>>>,
}

impl Cuttable {
    fn start(upstream: SocketAddr) -> Cuttable {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicBool::new(true));
        let live = Arc::new(Mutex::new(Vec::new()));
        let held = Arc::new(Mutex::new(Vec::new()));
        let (o, l, h) = (Arc::clone(&open), Arc::clone(&live), Arc::clone(&held));
        std::thread::spawn(move || {
            for client in listener.incoming().map_while(Result::ok) {
                if !o.load(Ordering::SeqCst) {
                    h.lock().unwrap().push(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream) else {
                    continue;
                };
                {
                    let mut l = l.lock().unwrap();
                    l.push(client.try_clone().unwrap());
                    l.push(server.try_clone().unwrap());
                }
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || pipe(client, server));
                std::thread::spawn(move || pipe(s2, c2));
            }
        });
        Cuttable {
            addr,
            open,
            live,
            held,
        }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for s in self.live.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    /// Forwards new connections again and closes the held ones, so the router reconnects.
    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
        for s in self.held.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let mut buf = [0u8; 16 << 10];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Both);
}

#[test]
fn events_lost_while_disconnected_are_replayed() {
    let Some(fleet) = fleet() else { return };
    let e = &fleet.a;
    let relay = Cuttable::start(format!("127.0.0.1:{}", e.kv_port).parse().unwrap());
    let mut r = router(
        &[
            vec![
                "--endpoint".into(),
                format!("{},kv=tcp://{},replay={}", e.url(), relay.addr, e.replay()),
            ],
            tokenizer_flag(),
        ]
        .concat(),
    );
    r.wait_connected(&[e]);
    let stream = format!("{}#0", e.address());
    relay.cut();
    r.kvgate.wait_for(
        "kv events disconnected, reconnecting; holdings unconfirmed until reconciled",
        1,
    );
    // A turn served while the router hears none of the engine's events.
    let system = system_prompt(501, 400);
    let (status, _, v) = r.chat(&chat_body(&system, &["first question"], 8));
    assert_eq!(status, 200, "{v}");
    let answer = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // The engine's count: the decision's is an estimate when routing tokenized a prefix.
    let held = v["usage"]["prompt_tokens"].as_u64().unwrap() / ENGINE_BLOCK;
    let replays = r.metric("kvgate_kv_replays_total", &[&stream, "reason=\"ok\""]);
    relay.restore();
    wait_until("the lost events replayed into the index", || {
        r.metric("kvgate_kv_unconfirmed", &[&stream]) == 0.0
            && holdings(r.admin, &e.address()) >= held
    });
    assert!(
        r.metric("kvgate_kv_replays_total", &[&stream, "reason=\"ok\""]) > replays,
        "no replay counted"
    );
    let follow = chat_body(&system, &["first question", &answer, "second question"], 8);
    let (status, _, v) = r.chat(&follow);
    assert_eq!(status, 200, "{v}");
    // The follow-up shares the first turn's prompt up to where the chat template renders the
    // answer in the history: the lost events are what put that prefix in the index.
    let d = r.decisions(2);
    assert!(
        d[1].predicted > 0,
        "the follow-up was predicted nothing: {d:#?}"
    );
    assert_eq!(d[1].predicted, d[1].realized, "{:#?}", d[1]);
}
