//! Block keys, the KV-cache index fed by engine KV events, event decoding and the ZMQ subscriber.
