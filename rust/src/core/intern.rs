//! A bounded intern cache keyed by bytes.
//!
//! The decoder maps each request id's bytes to one string object, so the same id decodes
//! to the same object frame after frame (the front-end's dict lookups then hit a cached
//! hash) and known ids skip UTF-8 checking and string allocation.
//!
//! Bounded with two generations: lookups hit `current` first, then `previous` (and a hit
//! there moves the entry back to `current`). When `current` holds half the capacity,
//! `previous` is dropped and `current` becomes `previous`. An id seen at least once per
//! generation (every live request) therefore stays; ids of finished requests age out
//! within two generations. At most `capacity` entries are ever held.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// A fast multiplicative hasher for short byte keys, seeded per cache so that forged
/// ids cannot be chosen to collide.
#[derive(Clone, Copy)]
pub struct SeededHasher {
    state: u64,
}

const MUL: u64 = 0x9e37_79b9_7f4a_7c15;

impl SeededHasher {
    #[inline]
    fn mix(&mut self, word: u64) {
        self.state = (self.state.rotate_left(23) ^ word).wrapping_mul(MUL);
    }
}

impl Hasher for SeededHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.mix(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            // The length byte keeps "a" and "a\0" apart.
            self.mix(u64::from_le_bytes(word) ^ ((rest.len() as u64) << 59));
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        self.mix(n as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        // Fold the high bits down: the table uses both ends of the hash.
        let h = self.state;
        (h ^ (h >> 29)).wrapping_mul(MUL) ^ (h >> 32)
    }
}

/// Builds [`SeededHasher`]s with one random seed.
#[derive(Clone, Copy)]
pub struct SeededState {
    seed: u64,
}

impl SeededState {
    /// A state with a fresh random seed.
    pub fn new() -> Self {
        SeededState {
            seed: RandomState::new().hash_one(0x636f_7265_7769_7265u64),
        }
    }
}

impl Default for SeededState {
    fn default() -> Self {
        Self::new()
    }
}

impl BuildHasher for SeededState {
    type Hasher = SeededHasher;
    #[inline]
    fn build_hasher(&self) -> SeededHasher {
        SeededHasher { state: self.seed }
    }
}

/// Maps byte strings to values, holding at most `capacity` entries.
pub struct InternCache<V> {
    current: HashMap<Box<[u8]>, V, SeededState>,
    previous: HashMap<Box<[u8]>, V, SeededState>,
    generation: usize,
    max_key_len: usize,
}

impl<V> InternCache<V> {
    /// Longest key worth caching by default; longer ids are built every time.
    pub const DEFAULT_MAX_KEY_LEN: usize = 256;

    /// A cache of at most `capacity` entries (at least 2).
    pub fn new(capacity: usize) -> Self {
        let generation = (capacity / 2).max(1);
        let state = SeededState::new();
        InternCache {
            current: HashMap::with_capacity_and_hasher(generation.min(4096), state),
            previous: HashMap::with_hasher(state),
            generation,
            max_key_len: Self::DEFAULT_MAX_KEY_LEN,
        }
    }

    /// Sets the longest key worth caching (longer keys are never cached).
    pub fn set_max_key_len(&mut self, max_key_len: usize) {
        self.max_key_len = max_key_len;
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.current.len() + self.previous.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Most entries ever held.
    pub fn capacity(&self) -> usize {
        self.generation * 2
    }

    /// The value for `key`, if cached.
    #[inline]
    pub fn get(&mut self, key: &[u8]) -> Option<&V> {
        if let Some(v) = self.current.get(key) {
            let v: *const V = v;
            // SAFETY: `v` points into `self.current`, which stays borrowed (through the
            // returned `&V`, tied to `&mut self`) and unmodified. The detour through a raw
            // pointer only works around the borrow checker's conditional-return limit
            // (NLL problem case #3), which would otherwise force hashing the key twice.
            return Some(unsafe { &*v });
        }
        self.promote(key)
    }

    #[inline(never)]
    fn promote(&mut self, key: &[u8]) -> Option<&V> {
        let (k, v) = self.previous.remove_entry(key)?;
        self.make_room();
        Some(self.current.entry(k).or_insert(v))
    }

    fn make_room(&mut self) {
        if self.current.len() >= self.generation {
            self.previous = std::mem::replace(
                &mut self.current,
                HashMap::with_capacity_and_hasher(self.generation.min(4096), SeededState::new()),
            );
        }
    }

    /// Caches `value` for `key` (keys longer than the limit are not cached) and
    /// returns the cached value.
    pub fn insert(&mut self, key: &[u8], value: V) -> Option<&V> {
        if key.len() > self.max_key_len {
            return None;
        }
        self.previous.remove(key);
        self.make_room();
        let slot = self.current.entry(key.into()).or_insert(value);
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hit_returns_the_same_value() {
        let mut c = InternCache::new(8);
        assert!(c.get(b"a").is_none());
        c.insert(b"a", 1);
        assert_eq!(c.get(b"a"), Some(&1));
        assert!(c.get(b"b").is_none());
        assert!(!c.is_empty());
    }

    #[test]
    fn bounded_and_live_keys_survive() {
        let mut c = InternCache::new(100);
        c.insert(b"live", 0);
        for i in 0..10_000u32 {
            let key = format!("cmpl-{i}");
            c.insert(key.as_bytes(), i);
            // A live request is looked up every step.
            assert_eq!(c.get(b"live"), Some(&0), "step {i}");
            assert!(c.len() <= c.capacity(), "{} > {}", c.len(), c.capacity());
        }
        assert!(c.len() <= 100);
        // Old keys aged out.
        assert!(c.get(b"cmpl-0").is_none());
    }

    #[test]
    fn long_keys_are_not_cached() {
        let mut c = InternCache::new(8);
        let long = vec![b'x'; 1000];
        assert!(c.insert(&long, 1).is_none());
        assert!(c.get(&long).is_none());
    }

    #[test]
    fn hasher_separates_lengths_and_seeds() {
        let s = SeededState::new();
        assert_ne!(s.hash_one(b"a".as_slice()), s.hash_one(b"a\0".as_slice()));
        assert_ne!(s.hash_one(b"".as_slice()), s.hash_one(b"\0".as_slice()));
        let t = SeededState::new();
        // Different seeds give different hashes (random seeds colliding is ~2^-64).
        assert_ne!(
            s.hash_one(b"same".as_slice()),
            t.hash_one(b"same".as_slice())
        );
    }
}
