//! `kvgate serve`: flag and file precedence, help text, validation, reload by content.

use clap::{CommandFactory, Parser};

use super::*;
use crate::{Cli, Command};

fn serve_args(flags: &[&str]) -> ServeArgs {
    let argv = ["kvgate", "serve"].iter().chain(flags);
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Serve(args) => args,
        other => panic!("not serve: {other:?}"),
    }
}

#[test]
fn listen_addresses_come_from_flag_then_file_then_default() {
    let addr = |s: &str| s.parse::<SocketAddr>().unwrap();
    let (proxy_default, admin_default) = (addr("0.0.0.0:8080"), addr("127.0.0.1:9090"));
    // (name, flags, YAML, want proxy, want admin): one source flipped per row.
    let cases: [(&str, &[&str], &str, SocketAddr, SocketAddr); 6] = [
        ("defaults", &[], "{}", proxy_default, admin_default),
        (
            "file listen leaves the admin default",
            &[],
            "listen: 127.0.0.1:1",
            addr("127.0.0.1:1"),
            admin_default,
        ),
        (
            "file admin_listen",
            &[],
            "admin_listen: 127.0.0.1:2",
            proxy_default,
            addr("127.0.0.1:2"),
        ),
        (
            "flag over file",
            &["--admin-listen", "127.0.0.1:3"],
            "admin_listen: 127.0.0.1:2",
            proxy_default,
            addr("127.0.0.1:3"),
        ),
        (
            "listen flag leaves the admin default",
            &["--listen", "127.0.0.1:4"],
            "{}",
            addr("127.0.0.1:4"),
            admin_default,
        ),
        (
            "proxy flag over file",
            &["--listen", "127.0.0.1:4"],
            "listen: 127.0.0.1:1",
            addr("127.0.0.1:4"),
            admin_default,
        ),
    ];
    for (name, flags, yaml, proxy, admin) in cases {
        let file = FileConfig::from_yaml(yaml).unwrap();
        assert_eq!(
            listen_addrs(&serve_args(flags), &file),
            (proxy, admin),
            "{name}"
        );
    }
    assert_eq!(
        (config::DEFAULT_LISTEN, config::DEFAULT_ADMIN_LISTEN),
        (proxy_default, admin_default)
    );
}

#[test]
fn help_shows_the_defaults_the_code_uses() {
    let mut cli = Cli::command();
    let help = cli
        .find_subcommand_mut("serve")
        .unwrap()
        .render_long_help()
        .to_string();
    let config = ProxyConfig::default();
    let human = |d| humantime::format_duration(d).to_string();
    for (flag, default) in [
        ("--listen ", config::DEFAULT_LISTEN.to_string()),
        ("--admin-listen ", config::DEFAULT_ADMIN_LISTEN.to_string()),
        ("--upstream-connect-timeout ", human(config.connect_timeout)),
        (
            "--upstream-pool-idle-timeout ",
            human(config.pool_idle_timeout),
        ),
        (
            "--kv-index-capacity-blocks ",
            config.kv_index.default_capacity_blocks.to_string(),
        ),
        (
            "--kv-speculative-ttl ",
            human(config.kv_index.speculative_ttl),
        ),
        (
            "--max-inflight-body-bytes ",
            format!("{} (1 GiB)", config.max_inflight_body_bytes),
        ),
    ] {
        let text = help.split(flag).nth(1).unwrap_or_default();
        let doc = text.split("\n\n").next().unwrap_or_default();
        let doc = doc.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(doc.contains(&format!("else {default}]")), "{flag}: {doc}");
    }
}

#[test]
fn upstream_and_index_flags_override_the_file() {
    let ms = Duration::from_millis;
    let yaml = "upstream: { connect_timeout_ms: 100, pool_idle_timeout_ms: 200 }\n\
                kv_index: { default_capacity_blocks: 300, speculative_ttl_ms: 400 }";
    let file = FileConfig::from_yaml(yaml).unwrap();
    let read = |c: &ProxyConfig| {
        (
            c.connect_timeout,
            c.pool_idle_timeout,
            c.kv_index.default_capacity_blocks,
            c.kv_index.speculative_ttl,
        )
    };
    let from_file = (ms(100), ms(200), 300, ms(400));
    // (name, flags, want): one flag per row, the rest from the file.
    let cases: [(&str, &[&str], _); 5] = [
        ("file only", &[], from_file),
        (
            "connect",
            &["--upstream-connect-timeout", "1s"],
            (ms(1000), ms(200), 300, ms(400)),
        ),
        (
            "pool idle",
            &["--upstream-pool-idle-timeout", "2m"],
            (ms(100), ms(120_000), 300, ms(400)),
        ),
        (
            "capacity",
            &["--kv-index-capacity-blocks", "7"],
            (ms(100), ms(200), 7, ms(400)),
        ),
        (
            "speculative ttl",
            &["--kv-speculative-ttl", "3s"],
            (ms(100), ms(200), 300, ms(3000)),
        ),
    ];
    for (name, flags, want) in cases {
        let config = proxy_config(&serve_args(flags), &file).unwrap();
        assert_eq!(read(&config), want, "{name}");
    }
    let defaults = proxy_config(&serve_args(&[]), &FileConfig::default()).unwrap();
    assert_eq!(
        read(&defaults),
        read(&ProxyConfig::default()),
        "no file, no flags"
    );
}

#[test]
fn tls_and_body_budget_flags_override_the_file() {
    let yaml = "tls: { cert_file: /f/cert.pem, key_file: /f/key.pem }\n\
                upstream: { ca_file: /f/ca.pem }\n\
                limits: { max_inflight_body_bytes: 1000 }";
    let file = FileConfig::from_yaml(yaml).unwrap();
    let read = |c: &ProxyConfig| {
        let tls = c.tls.as_ref().map(|t| {
            (
                t.cert_file.display().to_string(),
                t.key_file.display().to_string(),
            )
        });
        let ca = c.upstream_ca.as_ref().map(|p| p.display().to_string());
        (tls, ca, c.max_inflight_body_bytes)
    };
    let pair = |a: &str, b: &str| Some((a.to_owned(), b.to_owned()));
    let some = |a: &str| Some(a.to_owned());
    // (name, flags, YAML, want): one source flipped per row.
    let cases: [(&str, &[&str], &FileConfig, _); 5] = [
        (
            "nothing",
            &[],
            &FileConfig::default(),
            (None, None, 1 << 30),
        ),
        (
            "file",
            &[],
            &file,
            (pair("/f/cert.pem", "/f/key.pem"), some("/f/ca.pem"), 1000),
        ),
        (
            "tls flags over file",
            &["--tls-cert", "/c.pem", "--tls-key", "/k.pem"],
            &file,
            (pair("/c.pem", "/k.pem"), some("/f/ca.pem"), 1000),
        ),
        (
            "ca flag over file",
            &["--upstream-ca", "/ca2.pem"],
            &file,
            (pair("/f/cert.pem", "/f/key.pem"), some("/ca2.pem"), 1000),
        ),
        (
            "budget flag over file",
            &["--max-inflight-body-bytes", "5"],
            &file,
            (pair("/f/cert.pem", "/f/key.pem"), some("/f/ca.pem"), 5),
        ),
    ];
    for (name, flags, file, want) in cases {
        let config = proxy_config(&serve_args(flags), file).unwrap();
        assert_eq!(read(&config), want, "{name}");
    }
    // A certificate without its key (or the other way round) is refused by the parser.
    for flags in [["--tls-cert", "/c.pem"], ["--tls-key", "/k.pem"]] {
        let argv = ["kvgate", "serve"].iter().chain(&flags);
        let err = Cli::try_parse_from(argv).unwrap_err().to_string();
        assert!(err.contains("required"), "{flags:?}: {err}");
    }
}

#[test]
fn bad_flags_are_errors_naming_the_flag() {
    // (flags, what the message must name): one bad flag per row.
    let cases: [(&[&str], &str); 9] = [
        (
            &["--endpoint", "http://a:1,bogus=1"],
            "endpoint flag `http://a:1,bogus=1`",
        ),
        (&["--render", "qwen"], "render flag `qwen`"),
        (&["--alias", "qwen"], "alias flag `qwen`"),
        (&["--tokenizer", "qwen"], "--tokenizer `qwen`"),
        (
            &["--upstream-connect-timeout", "0s"],
            "upstream.connect_timeout_ms",
        ),
        (
            &["--upstream-pool-idle-timeout", "0s"],
            "upstream.pool_idle_timeout_ms",
        ),
        (
            &["--kv-index-capacity-blocks", "0"],
            "kv_index.default_capacity_blocks",
        ),
        (
            &["--kv-speculative-ttl", "0s"],
            "kv_index.speculative_ttl_ms",
        ),
        (
            &["--max-inflight-body-bytes", "0"],
            "limits.max_inflight_body_bytes",
        ),
    ];
    for (flags, want) in cases {
        let err = proxy_config(&serve_args(flags), &FileConfig::default()).unwrap_err();
        assert!(format!("{err:#}").contains(want), "{flags:?}: {err:#}");
    }
}

#[test]
fn reload_follows_content_not_writes() {
    let mut seen = SeenConfig("a: 1\n".into());
    // (name, file content now, reload wanted): in order, each against the previous row.
    let cases = [
        ("touched, same bytes", "a: 1\n", false),
        ("edited", "a: 2\n", true),
        ("read again unchanged", "a: 2\n", false),
        ("reverted", "a: 1\n", true),
    ];
    for (name, text, want) in cases {
        let got = seen.changed(text.to_owned());
        assert_eq!(got.is_some(), want, "{name}");
        if want {
            assert_eq!(got, Some(text), "{name}");
        }
    }
}
