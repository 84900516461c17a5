//! One real vLLM engine process (vLLM 0.32's CPU build, `serve.sh` of the vllm-cpu tools):
//! started in a process group of its own under a watchdog that ends the group when this test
//! process is gone, so no engine outlives a crashed or killed test run.

use std::{
    net::TcpListener,
    os::unix::process::CommandExt,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use super::Install;

/// How long an engine may take from spawn to `/health` 200 (about 25 s alone on 2 cores;
/// 30-90 s while another engine or a build shares the cores).
const READY: Duration = Duration::from_secs(420);

/// What to start: the model directory under the install, the core its compute threads are
/// bound to, and extra `vllm serve` arguments.
#[derive(Debug, Clone)]
pub(crate) struct EngineSpec {
    /// `tiny-qwen3` (plain attention) or `tiny-gemma3` (sliding window + full attention).
    pub(crate) model: &'static str,
    /// `VLLM_CPU_OMP_THREADS_BIND`.
    pub(crate) cpu: &'static str,
    /// Extra engine arguments, e.g. `--enable-scale-out`, `--num-gpu-blocks-override 160`.
    pub(crate) args: Vec<String>,
}

/// A running (or stopped) engine on fixed ports: `port` for HTTP, `kv_port` for KV events and
/// `kv_port + 1` for their replay.
pub(crate) struct RealEngine {
    pub(crate) port: u16,
    pub(crate) kv_port: u16,
    spec: EngineSpec,
    install: Install,
    child: Option<Child>,
    log: PathBuf,
    starts: u32,
}

impl RealEngine {
    /// Picks free ports and starts the engine; returns once `/health` answers 200.
    pub(crate) fn start(install: &Install, spec: EngineSpec) -> RealEngine {
        let port = free_port();
        let kv_port = free_port_pair();
        let log = std::env::temp_dir().join(format!("kvgate-real-vllm-{port}.log"));
        let mut e = RealEngine {
            port,
            kv_port,
            spec,
            install: install.clone(),
            child: None,
            log,
            starts: 0,
        };
        e.spawn();
        e.wait_ready();
        e
    }

    /// `http://127.0.0.1:PORT`.
    pub(crate) fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `127.0.0.1:PORT`, the endpoint's name in kvgate's metrics and decisions.
    pub(crate) fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// `tcp://127.0.0.1:KV_PORT`.
    pub(crate) fn kv(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.kv_port)
    }

    /// `tcp://127.0.0.1:KV_PORT+1`.
    pub(crate) fn replay(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.kv_port + 1)
    }

    /// `URL,kv=…,replay=…`: the `--endpoint` flag with the event stream configured.
    pub(crate) fn endpoint_flag(&self) -> String {
        format!("{},kv={},replay={}", self.url(), self.kv(), self.replay())
    }

    fn spawn(&mut self) {
        self.starts += 1;
        let serve = self.install.tools.join("serve.sh");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        // The group leader runs the engine, then ignores SIGTERM (the engine was spawned
        // before the trap, so it keeps the default) and polls: once this test process or the
        // engine is gone, it ends the whole group.
        let script = r#"P=$1; shift; "$@" & E=$!; trap '' TERM
while kill -0 "$P" 2>/dev/null && kill -0 "$E" 2>/dev/null; do sleep 1; done
kill -TERM 0 2>/dev/null; sleep 5; kill -KILL 0 2>/dev/null"#;
        let child = Command::new("bash")
            .arg("-c")
            .arg(script)
            .arg("watchdog")
            .arg(std::process::id().to_string())
            .arg("bash")
            .arg(&serve)
            .arg(self.port.to_string())
            .arg(self.kv_port.to_string())
            .args(&self.spec.args)
            .env("VLLM_CPU_HOME", &self.install.home)
            .env("MODEL", self.spec.model)
            .env("VLLM_CPU_OMP_THREADS_BIND", self.spec.cpu)
            .env("VLLM_SERVER_DEV_MODE", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        self.child = Some(child);
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + READY;
        loop {
            if health(self.port) {
                return;
            }
            if let Some(c) = self.child.as_mut()
                && let Ok(Some(status)) = c.try_wait()
            {
                panic!(
                    "engine on :{} exited with {status} before it was ready:\n{}",
                    self.port,
                    self.log_tail()
                );
            }
            assert!(
                Instant::now() < deadline,
                "engine on :{} not ready in {READY:?}:\n{}",
                self.port,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Ends the engine's process group (SIGTERM, then SIGKILL after 30 s) and waits for its
    /// ports to be free again.
    pub(crate) fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let group = format!("-{}", child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while group_alive(&group) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(200));
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = child.wait();
        let deadline = Instant::now() + Duration::from_secs(60);
        while !(bindable(self.port) && bindable(self.kv_port) && bindable(self.kv_port + 1)) {
            assert!(
                Instant::now() < deadline,
                "ports of :{} not freed",
                self.port
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Kills the engine and starts a new process on the same ports; returns once it is ready.
    pub(crate) fn restart(&mut self) {
        self.stop();
        self.spawn();
        self.wait_ready();
    }

    /// The last lines of the engine's log.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for RealEngine {
    fn drop(&mut self) {
        self.stop();
    }
}

fn group_alive(group: &str) -> bool {
    Command::new("kill")
        .args(["-0", "--", group])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn health(port: u16) -> bool {
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    use std::io::{Read, Write};
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    if s.write_all(b"GET /health HTTP/1.1\r\nhost: e\r\nconnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    buf.starts_with(b"HTTP/1.1 200")
}

fn bindable(port: u16) -> bool {
    TcpListener::bind(("0.0.0.0", port)).is_ok()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A port `p` with `p` and `p + 1` both free (the engine binds its replay socket at `p + 1`).
fn free_port_pair() -> u16 {
    loop {
        let p = free_port();
        if p < u16::MAX && bindable(p) && bindable(p + 1) {
            return p;
        }
    }
}
