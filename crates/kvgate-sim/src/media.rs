//! Image content parts of chat requests, expanded as a Qwen2-VL-family vLLM engine expands
//! them: each image becomes `<|vision_start|>` + N × `<|image_pad|>` + `<|vision_end|>` in
//! the prompt, and the N pad tokens are the item's placeholder range (`mm_placeholders`).
//!
//! Simulator rules (documented stand-ins for what a real processor computes from pixels):
//! - Only `data:<type>;base64,<payload>` URLs are taken; anything else (an `http(s)://` URL
//!   included) is a 400: the simulator never fetches media.
//! - N = ⌈decoded bytes / [`BYTES_PER_IMAGE_TOKEN`]⌉ (at least 1), so a larger image spans
//!   more blocks. Render and generation share this code, so they always agree.
//! - The item's identifier (`mm_hashes` entry) is the part's `uuid` when it has one (as vLLM
//!   uses a client-given uuid), else the lowercase hex SHA-256 of the whole data URL. vLLM
//!   hashes the decoded item with blake3; only its role matters here: the same image gives
//!   the same identifier, a different one a different identifier. The router never computes
//!   it: it reads it from `/render`.
//!
//! The parts are rewritten to a text part holding the three marker tokens, the body is
//! tokenized by the usual local path, and each `<|image_pad|>` is then widened to N tokens.

use serde_json::Value;
use sha2::{Digest, Sha256};

/// Decoded image bytes per placeholder token.
pub(crate) const BYTES_PER_IMAGE_TOKEN: usize = 8;
/// The marker text an image part becomes before tokenization.
const IMAGE_MARKER: &str = "<|vision_start|><|image_pad|><|vision_end|>";
/// The placeholder token widened to the image's token count.
pub(crate) const IMAGE_PAD: &str = "<|image_pad|>";

/// One multimodal item of a prompt: its identifier and placeholder range.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MmFeature {
    /// The item's hash (`mm_hashes` entry, the `extra_keys` identifier).
    pub(crate) identifier: String,
    /// Index of the first placeholder token.
    pub(crate) offset: usize,
    /// Number of placeholder tokens.
    pub(crate) length: usize,
}

/// An image part taken out of a body, before its placeholders are placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Image {
    identifier: String,
    tokens: usize,
}

/// A chat body with its image parts replaced, and the images in prompt order.
pub(crate) type TakenImages = (Vec<u8>, Vec<Image>);

/// Takes the image parts out of a chat body: the body with each one replaced by the marker
/// text part, and the images in prompt order. `Ok(None)` when there is no image part (or the
/// body is not JSON: the tokenizer reports that).
///
/// # Errors
/// A message for the client (400) when an image part has no usable data URL.
pub(crate) fn take_images(body: &[u8]) -> Result<Option<TakenImages>, String> {
    let Ok(mut v) = serde_json::from_slice::<Value>(body) else {
        return Ok(None);
    };
    let mut images = Vec::new();
    let messages = v.get_mut("messages").and_then(Value::as_array_mut);
    for message in messages.into_iter().flatten() {
        let parts = message.get_mut("content").and_then(Value::as_array_mut);
        for part in parts.into_iter().flatten() {
            if !is_image_part(part) {
                continue;
            }
            images.push(image(part)?);
            *part = serde_json::json!({"type": "text", "text": IMAGE_MARKER});
        }
    }
    if images.is_empty() {
        return Ok(None);
    }
    let body = serde_json::to_vec(&v).map_err(|e| format!("request body: {e}"))?;
    Ok(Some((body, images)))
}

fn is_image_part(part: &Value) -> bool {
    part.get("type").and_then(Value::as_str) == Some("image_url") || part.get("image_url").is_some()
}

fn image(part: &Value) -> Result<Image, String> {
    let url = part
        .get("image_url")
        .and_then(|u| u.get("url").or(Some(u)))
        .and_then(Value::as_str)
        .ok_or("image_url content part without a url string")?;
    let decoded = data_url_len(url)?;
    let identifier = match part.get("uuid").and_then(Value::as_str) {
        Some(uuid) if !uuid.is_empty() => uuid.to_owned(),
        _ => Sha256::digest(url.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    };
    Ok(Image {
        identifier,
        tokens: decoded.div_ceil(BYTES_PER_IMAGE_TOKEN).max(1),
    })
}

/// The decoded length of a `data:…;base64,…` URL's payload.
fn data_url_len(url: &str) -> Result<usize, String> {
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split_once(':').map_or("a relative", |(s, _)| s);
        return Err(format!(
            "the simulator only takes data: image URLs (base64), not {scheme} URLs; it never fetches media"
        ));
    };
    let (_, payload) = rest
        .split_once(";base64,")
        .ok_or("image data URL is not base64 (expected data:<type>;base64,<payload>)")?;
    let body = payload.trim_end_matches('=');
    let pad = payload.len() - body.len();
    let valid = !body.is_empty()
        && pad <= 2
        && payload.len() % 4 == 0
        && body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/');
    if !valid {
        return Err("image data URL payload is not valid base64".into());
    }
    Ok(payload.len() / 4 * 3 - pad)
}

/// Widens each `<|image_pad|>` of `tokens` (one per image, in order) to the image's tokens and
/// returns the prompt with its items' placeholder ranges.
///
/// # Errors
/// A message for the client (400) when the prompt's pad tokens do not pair up with the images
/// (the text itself holds `<|image_pad|>`), or the model has no such token.
pub(crate) fn expand(
    tokens: &[u32],
    images: Vec<Image>,
    pad: Option<u32>,
) -> Result<(Vec<u32>, Vec<MmFeature>), String> {
    let pad = pad.ok_or("this model takes no images (its tokenizer has no <|image_pad|>)")?;
    let pads = tokens.iter().filter(|&&t| t == pad).count();
    if pads != images.len() {
        return Err(format!(
            "{pads} {IMAGE_PAD} tokens in the prompt for {} images: text may not hold {IMAGE_PAD}",
            images.len()
        ));
    }
    let extra: usize = images.iter().map(|i| i.tokens - 1).sum();
    let mut out = Vec::with_capacity(tokens.len() + extra);
    let mut features = Vec::with_capacity(images.len());
    let mut images = images.into_iter();
    for &t in tokens {
        if t != pad {
            out.push(t);
            continue;
        }
        let Some(image) = images.next() else {
            return Err("more image placeholders than images".into());
        };
        features.push(MmFeature {
            identifier: image.identifier,
            offset: out.len(),
            length: image.tokens,
        });
        out.resize(out.len() + image.tokens, pad);
    }
    Ok((out, features))
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAD: u32 = 9;

    #[test]
    fn data_urls() {
        let cases: Vec<(&str, Result<usize, &str>)> = vec![
            ("data:image/png;base64,AAAA", Ok(3)),
            ("data:image/png;base64,AAA=", Ok(2)),
            ("data:image/png;base64,AA==", Ok(1)),
            ("data:;base64,QUJDREVGR0g=", Ok(8)),
            (
                "https://example.com/cat.png",
                Err("the simulator only takes data:"),
            ),
            (
                "http://example.com/cat.png",
                Err("the simulator only takes data:"),
            ),
            ("cat.png", Err("the simulator only takes data:")),
            (
                "data:image/png,rawbytes",
                Err("image data URL is not base64"),
            ),
            (
                "data:image/png;base64,",
                Err("image data URL payload is not valid"),
            ),
            (
                "data:image/png;base64,AAA",
                Err("image data URL payload is not valid"),
            ),
            (
                "data:image/png;base64,A===",
                Err("image data URL payload is not valid"),
            ),
            (
                "data:image/png;base64,AA*A",
                Err("image data URL payload is not valid"),
            ),
        ];
        for (url, want) in cases {
            match (data_url_len(url), want) {
                (Ok(n), Ok(w)) => assert_eq!(n, w, "{url}"),
                (Err(e), Err(w)) => assert!(e.starts_with(w), "{url}: {e}"),
                (got, want) => panic!("{url}: got {got:?}, want {want:?}"),
            }
        }
    }

    #[test]
    fn take_images_rewrites_parts_and_names_items() {
        let url = format!("data:image/png;base64,{}", "QUJD".repeat(10)); // 30 bytes
        let body = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "image_url", "image_url": {"url": url}, "uuid": "my-image"},
        ]}]});
        let (rewritten, images) = take_images(body.to_string().as_bytes()).unwrap().unwrap();
        let v: Value = serde_json::from_slice(&rewritten).unwrap();
        assert_eq!(v["messages"][0]["content"][1]["text"], IMAGE_MARKER);
        assert_eq!(v["messages"][0]["content"][0]["text"], "look");
        assert_eq!(images.len(), 2);
        assert_eq!(images[0].tokens, 4, "30 bytes / 8 per token, rounded up");
        assert_eq!(images[0].identifier.len(), 64);
        assert_eq!(images[1].identifier, "my-image");
        let other = format!("data:image/png;base64,{}", "QUJE".repeat(10));
        let body2 = serde_json::json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": other}}]}]});
        let (_, images2) = take_images(body2.to_string().as_bytes()).unwrap().unwrap();
        assert_ne!(images2[0].identifier, images[0].identifier);

        let text_only = br#"{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}"#;
        assert_eq!(take_images(text_only).unwrap(), None);
        assert_eq!(take_images(b"not json").unwrap(), None);
        let remote = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}}]}]}"#;
        assert!(
            take_images(remote)
                .unwrap_err()
                .contains("only takes data:")
        );
        let no_url =
            br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#;
        assert!(take_images(no_url).unwrap_err().contains("without a url"));
    }

    #[test]
    fn expand_places_each_image() {
        let img = |id: &str, tokens| Image {
            identifier: id.into(),
            tokens,
        };
        let (toks, mm) = expand(
            &[1, 2, PAD, 3, PAD, 4],
            vec![img("a", 3), img("b", 2)],
            Some(PAD),
        )
        .unwrap();
        assert_eq!(toks, vec![1, 2, PAD, PAD, PAD, 3, PAD, PAD, 4]);
        assert_eq!(
            mm,
            vec![
                MmFeature {
                    identifier: "a".into(),
                    offset: 2,
                    length: 3
                },
                MmFeature {
                    identifier: "b".into(),
                    offset: 6,
                    length: 2
                },
            ]
        );
        assert!(expand(&[PAD, PAD], vec![img("a", 3)], Some(PAD)).is_err());
        assert!(expand(&[1], vec![img("a", 3)], Some(PAD)).is_err());
        assert!(expand(&[PAD], vec![img("a", 3)], None).is_err());
    }
}
