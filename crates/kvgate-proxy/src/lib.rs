//! The standalone HTTP proxy: forwarding, streaming, retries, admission and the admin server.
