//! A YAML value tree that keeps each node's line and column, and a serde `Deserializer` over it
//! whose errors carry the location of the node (or key) at fault.
//!
//! Plugin parameters are parsed in two phases: the file is read once into typed specs whose
//! `parameters` are a [`Node`]; once the plugin type is known, its `XConfig` is deserialized
//! from that node. Without the tree the second phase would lose the line numbers serde-saphyr
//! gives the first.

use std::fmt;

use serde::de::{self, DeserializeSeed, IntoDeserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_saphyr::{Location, Spanned};

/// A YAML node: scalars, sequences and mappings with string keys, each child located.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// `null`, `~` or empty.
    Null,
    /// A boolean.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// An unsigned integer too large for `i64`.
    UInt(u64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A sequence.
    Seq(Vec<Spanned<Node>>),
    /// A mapping, keys in document order.
    Map(Vec<(Spanned<String>, Spanned<Node>)>),
}

impl<'de> Deserialize<'de> for Node {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Node, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Node;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a YAML value")
            }
            fn visit_unit<E>(self) -> Result<Node, E> {
                Ok(Node::Null)
            }
            fn visit_none<E>(self) -> Result<Node, E> {
                Ok(Node::Null)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Node, D::Error> {
                Node::deserialize(d)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Node, E> {
                Ok(Node::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Node, E> {
                Ok(Node::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Node, E> {
                Ok(i64::try_from(v).map_or(Node::UInt(v), Node::Int))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Node, E> {
                Ok(Node::Float(v))
            }
            fn visit_str<E>(self, v: &str) -> Result<Node, E> {
                Ok(Node::Str(v.to_owned()))
            }
            fn visit_string<E>(self, v: String) -> Result<Node, E> {
                Ok(Node::Str(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<Node, A::Error> {
                let mut out = Vec::new();
                while let Some(v) = a.next_element::<Spanned<Node>>()? {
                    out.push(v);
                }
                Ok(Node::Seq(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<Node, A::Error> {
                let mut out = Vec::new();
                while let Some(k) = a.next_key::<Spanned<String>>()? {
                    let v = a.next_value::<Spanned<Node>>()?;
                    out.push((k, v));
                }
                Ok(Node::Map(out))
            }
        }
        d.deserialize_any(V)
    }
}

/// A deserialization error with the location of the node that caused it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeError {
    /// What went wrong (serde's message).
    pub message: String,
    /// Where: 1-based line and column (0 when unknown).
    pub line: u32,
    /// 1-based column.
    pub column: u32,
}

impl fmt::Display for NodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for NodeError {}

impl de::Error for NodeError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        NodeError {
            message: msg.to_string(),
            line: 0,
            column: 0,
        }
    }
}

impl NodeError {
    fn at(mut self, loc: Location) -> Self {
        if self.line == 0 {
            self.line = loc.line() as u32;
            self.column = loc.column() as u32;
        }
        self
    }
}

/// Deserializes `T` from a located node; the error names the line of the offending node.
pub(crate) fn from_node<'a, T: Deserialize<'a>>(node: &'a Spanned<Node>) -> Result<T, NodeError> {
    T::deserialize(NodeDe(node)).map_err(|e| e.at(node.referenced))
}

/// A deserializer over a located node.
struct NodeDe<'a>(&'a Spanned<Node>);

impl<'de> Deserializer<'de> for NodeDe<'de> {
    type Error = NodeError;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, NodeError> {
        let loc = self.0.referenced;
        let r = match &self.0.value {
            Node::Null => v.visit_unit(),
            Node::Bool(b) => v.visit_bool(*b),
            Node::Int(i) => v.visit_i64(*i),
            Node::UInt(u) => v.visit_u64(*u),
            Node::Float(f) => v.visit_f64(*f),
            Node::Str(s) => v.visit_borrowed_str(s),
            Node::Seq(items) => v.visit_seq(Seq { items, i: 0 }),
            Node::Map(entries) => v.visit_map(Map {
                entries,
                i: 0,
                value: None,
            }),
        };
        r.map_err(|e| e.at(loc))
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, NodeError> {
        match self.0.value {
            Node::Null => v.visit_none(),
            _ => v.visit_some(self),
        }
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, NodeError> {
        let loc = self.0.referenced;
        let r = match &self.0.value {
            Node::Str(s) => v.visit_enum(s.as_str().into_deserializer()),
            Node::Map(entries) if entries.len() == 1 => {
                v.visit_enum(de::value::MapAccessDeserializer::new(Map {
                    entries,
                    i: 0,
                    value: None,
                }))
            }
            _ => Err(de::Error::custom("expected a variant name")),
        };
        r.map_err(|e: NodeError| e.at(loc))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        v: V,
    ) -> Result<V::Value, NodeError> {
        v.visit_newtype_struct(self)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string
        bytes byte_buf unit unit_struct seq tuple tuple_struct map struct identifier ignored_any
    }
}

struct Seq<'a> {
    items: &'a [Spanned<Node>],
    i: usize,
}

impl<'de> SeqAccess<'de> for Seq<'de> {
    type Error = NodeError;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, NodeError> {
        let Some(item) = self.items.get(self.i) else {
            return Ok(None);
        };
        self.i += 1;
        seed.deserialize(NodeDe(item))
            .map(Some)
            .map_err(|e| e.at(item.referenced))
    }
}

struct Map<'a> {
    entries: &'a [(Spanned<String>, Spanned<Node>)],
    i: usize,
    value: Option<&'a Spanned<Node>>,
}

impl<'de> MapAccess<'de> for Map<'de> {
    type Error = NodeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, NodeError> {
        let Some((k, v)) = self.entries.get(self.i) else {
            return Ok(None);
        };
        self.i += 1;
        self.value = Some(v);
        let key: de::value::BorrowedStrDeserializer<'de, NodeError> =
            de::value::BorrowedStrDeserializer::new(k.value.as_str());
        seed.deserialize(key)
            .map(Some)
            .map_err(|e| e.at(k.referenced))
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, NodeError> {
        let v = self
            .value
            .take()
            .ok_or_else(|| <NodeError as de::Error>::custom("value without a key"))?;
        seed.deserialize(NodeDe(v)).map_err(|e| e.at(v.referenced))
    }
}

impl<'de> de::EnumAccess<'de> for Map<'de> {
    type Error = NodeError;
    type Variant = NodeDe<'de>;

    fn variant_seed<V: DeserializeSeed<'de>>(
        mut self,
        seed: V,
    ) -> Result<(V::Value, NodeDe<'de>), NodeError> {
        let key = self.next_key_seed(seed)?;
        let (Some(key), Some(v)) = (key, self.value) else {
            return Err(de::Error::custom("expected a variant"));
        };
        Ok((key, NodeDe(v)))
    }
}

impl<'de> de::VariantAccess<'de> for NodeDe<'de> {
    type Error = NodeError;

    fn unit_variant(self) -> Result<(), NodeError> {
        Ok(())
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, NodeError> {
        seed.deserialize(self)
    }

    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, v: V) -> Result<V::Value, NodeError> {
        self.deserialize_any(v)
    }

    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, NodeError> {
        self.deserialize_any(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize, PartialEq, Default)]
    #[serde(deny_unknown_fields, default)]
    struct P {
        a: u32,
        b: Option<String>,
        c: Vec<f64>,
        mode: Mode,
    }

    #[derive(Debug, Deserialize, PartialEq, Default)]
    #[serde(rename_all = "snake_case")]
    enum Mode {
        #[default]
        Fast,
        Slow,
    }

    fn parse(yaml: &str) -> Result<P, NodeError> {
        let node: Spanned<Node> = serde_saphyr::from_str(yaml).unwrap();
        from_node(&node)
    }

    #[test]
    fn typed_from_located_tree() {
        let p = parse("a: 3\nb: x\nc: [1, 2.5]\nmode: slow\n").unwrap();
        assert_eq!(
            p,
            P {
                a: 3,
                b: Some("x".into()),
                c: vec![1.0, 2.5],
                mode: Mode::Slow
            }
        );
        assert_eq!(parse("{}").unwrap(), P::default());
    }

    #[test]
    fn errors_name_the_line() {
        let cases = [
            ("unknown key", "a: 1\n\nzzz: 2\n", 3, "zzz"),
            ("bad type", "a: 1\nb: x\nc:\n  - 1\n  - nope\n", 5, "nope"),
            ("negative", "b: x\na: -1\n", 2, "-1"),
            ("bad variant", "a: 1\nmode: warp\n", 2, "warp"),
        ];
        for (name, yaml, line, word) in cases {
            let e = parse(yaml).unwrap_err();
            assert_eq!(e.line, line, "{name}: {e:?}");
            assert!(e.message.contains(word), "{name}: {e:?}");
        }
    }
}
