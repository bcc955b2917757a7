//! The values a window is grouped by: a job's key, one string per declared group-by field.

use std::fmt;

use compact_str::CompactString;
use serde::de::{SeqAccess, Visitor};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use smallvec::SmallVec;

/// A window's group-by values in the declaration's order (revenue_agg: customer, then currency).
/// Two parts live inline, like the strings in them: a record's key allocates nothing for most
/// jobs. Ordered part by part, as strings.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct GroupKey(SmallVec<[CompactString; 2]>);

impl GroupKey {
    pub fn new(parts: impl IntoIterator<Item = CompactString>) -> GroupKey {
        GroupKey(parts.into_iter().collect())
    }

    pub fn from_parts(parts: SmallVec<[CompactString; 2]>) -> GroupKey {
        GroupKey(parts)
    }

    pub fn parts(&self) -> &[CompactString] {
        &self.0
    }

    /// Part `i`, empty when the key has fewer parts.
    pub fn part(&self, i: usize) -> &str {
        self.0.get(i).map_or("", CompactString::as_str)
    }

    /// The bytes of its parts together, for memory estimates and chunk sizes.
    pub fn text_len(&self) -> usize {
        self.0.iter().map(CompactString::len).sum()
    }
}

impl<const N: usize> From<[&str; N]> for GroupKey {
    fn from(parts: [&str; N]) -> GroupKey {
        GroupKey::new(parts.into_iter().map(CompactString::from))
    }
}

/// A sequence of strings: the parts say how many they are.
impl Serialize for GroupKey {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
        for part in &self.0 {
            seq.serialize_element(part.as_str())?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for GroupKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<GroupKey, D::Error> {
        struct Parts;
        impl<'de> Visitor<'de> for Parts {
            type Value = GroupKey;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a sequence of strings")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<GroupKey, A::Error> {
                let mut parts = SmallVec::new();
                while let Some(part) = seq.next_element::<CompactString>()? {
                    parts.push(part);
                }
                Ok(GroupKey(parts))
            }
        }
        deserializer.deserialize_seq(Parts)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_part_by_part_as_strings() {
        let key = |a: &str, b: &str| GroupKey::from([a, b]);
        // The order of (customer, currency) tuples: the first part decides, then the second.
        assert!(key("a", "ZZZ") < key("b", "AAA"));
        assert!(key("ab", "A") > key("a", "Z"));
        assert!(key("a", "A") < key("a", "B"));
        assert_eq!(key("x", "EUR").part(1), "EUR");
        assert_eq!(key("x", "EUR").part(2), "");
        assert_eq!(key("xy", "EUR").text_len(), 5);
    }

    proptest::proptest! {
        #[test]
        fn keys_round_trip_through_bincode(parts in proptest::collection::vec("[a-c\\x00ü]{0,30}", 0..5)) {
            let key = GroupKey::new(parts.iter().map(|p| CompactString::from(p.as_str())));
            let config = bincode::config::standard();
            let bytes = bincode::serde::encode_to_vec(&key, config).expect("encodes");
            let (back, read): (GroupKey, usize) =
                bincode::serde::decode_from_slice(&bytes, config).expect("decodes");
            proptest::prop_assert_eq!(read, bytes.len());
            proptest::prop_assert_eq!(back, key);
        }
    }
}
