//! Call-id registry: maps the id of each in-flight utility call to whatever the caller
//! waits on (a future, in the bindings).
//!
//! Ids are unsigned 64-bit values from a random start, like vLLM's `uuid1().int >> 64`,
//! so ids above 2**63 are normal and ids from two clients of one engine rarely meet.
//! A reply for an id that is not registered (cancelled caller, duplicate, stray frame)
//! finds nothing and changes nothing.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};

/// Error of [`Registry::register`] once the registry is closed (the engine died).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed;

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the call registry is closed: the engine is dead")
    }
}

impl std::error::Error for Closed {}

/// Hasher for keys that are already well spread: sequential ids from a random start.
///
/// SipHash would cost more than the rest of a lookup; a multiplicative mix keeps
/// sequential ids spread over the table's buckets.
#[derive(Default, Clone, Copy)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used by `u64` keys; this keeps the trait total.
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, n: u64) {
        // Fibonacci hashing: the high bits, which hashbrown uses, depend on every input bit.
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// `call_id -> V` with id allocation, for the utility calls in flight.
#[derive(Debug)]
pub struct Registry<V> {
    pending: HashMap<u64, V, BuildHasherDefault<IdHasher>>,
    next_id: u64,
    closed: bool,
}

/// A random 64-bit value from the standard library's per-process hash keys.
fn random_u64() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(std::process::id().into());
    hasher.finish()
}

impl<V> Default for Registry<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V> Registry<V> {
    /// An empty registry whose first id is random.
    pub fn new() -> Self {
        Self::starting_at(random_u64())
    }

    /// An empty registry whose first id is `start` (tests, reproducible runs).
    pub fn starting_at(start: u64) -> Self {
        Self {
            pending: HashMap::default(),
            next_id: start,
            closed: false,
        }
    }

    /// Stores `value` under a fresh id and returns the id.
    ///
    /// Ids wrap around at 2**64 and skip ids still in use, so an id is never handed out
    /// twice while its call is pending.
    pub fn register(&mut self, value: V) -> Result<u64, Closed> {
        if self.closed {
            return Err(Closed);
        }
        loop {
            let id = self.next_id;
            self.next_id = id.wrapping_add(1);
            if let Entry::Vacant(slot) = self.pending.entry(id) {
                slot.insert(value);
                return Ok(id);
            }
        }
    }

    /// Removes and returns the value of `id`; `None` for an unknown id.
    #[inline]
    pub fn pop(&mut self, id: u64) -> Option<V> {
        self.pending.remove(&id)
    }

    /// Whether `id` is pending.
    pub fn contains(&self, id: u64) -> bool {
        self.pending.contains_key(&id)
    }

    /// Removes every pending value and returns them; with `close`, later
    /// [`register`](Self::register) calls fail with [`Closed`].
    pub fn drain(&mut self, close: bool) -> Vec<V> {
        self.closed |= close;
        // Shrink too: after a burst of calls the table would otherwise keep its peak size.
        std::mem::take(&mut self.pending).into_values().collect()
    }

    /// Whether [`drain`](Self::drain) closed the registry.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// Number of pending calls.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether no call is pending.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_unique_and_pop_returns_the_value() {
        let mut reg = Registry::starting_at(10);
        let a = reg.register("a").unwrap();
        let b = reg.register("b").unwrap();
        assert_ne!(a, b);
        assert_eq!(reg.len(), 2);
        assert_eq!(reg.pop(b), Some("b"));
        assert_eq!(
            reg.pop(b),
            None,
            "a second reply for the same id finds nothing"
        );
        assert_eq!(reg.pop(a), Some("a"));
        assert!(reg.is_empty());
    }

    #[test]
    fn ids_above_2_pow_63_and_wraparound() {
        let mut reg = Registry::starting_at(u64::MAX - 1);
        let a = reg.register(1).unwrap();
        let b = reg.register(2).unwrap();
        let c = reg.register(3).unwrap();
        assert_eq!((a, b, c), (u64::MAX - 1, u64::MAX, 0));
        assert!(a > 1 << 63);
        assert_eq!(reg.pop(u64::MAX), Some(2));
    }

    #[test]
    fn wraparound_skips_ids_still_pending() {
        let mut reg = Registry::starting_at(u64::MAX);
        let first = reg.register('x').unwrap();
        // Force the counter back onto the pending id.
        reg.next_id = first;
        let second = reg.register('y').unwrap();
        assert_ne!(first, second);
        assert_eq!(reg.pop(first), Some('x'));
        assert_eq!(reg.pop(second), Some('y'));
    }

    #[test]
    fn unknown_id_is_harmless() {
        let mut reg = Registry::starting_at(5);
        let id = reg.register(()).unwrap();
        assert_eq!(reg.pop(id.wrapping_add(1000)), None);
        assert!(reg.contains(id));
        assert_eq!(reg.len(), 1);
    }

    #[test]
    fn drain_returns_everything_and_close_refuses_new_calls() {
        let mut reg = Registry::starting_at(0);
        for i in 0..100 {
            reg.register(i).unwrap();
        }
        let mut drained = reg.drain(false);
        drained.sort_unstable();
        assert_eq!(drained, (0..100).collect::<Vec<_>>());
        assert!(reg.is_empty());
        assert!(!reg.is_closed());
        reg.register(7).unwrap();
        assert_eq!(reg.drain(true), vec![7]);
        assert!(reg.is_closed());
        assert_eq!(reg.register(8), Err(Closed));
        assert!(reg.is_empty());
    }

    #[test]
    fn random_starts_differ() {
        let starts: std::collections::HashSet<u64> =
            (0..8).map(|_| Registry::<()>::new().next_id).collect();
        assert!(
            starts.len() > 1,
            "RandomState keys should vary per instance"
        );
    }

    #[test]
    fn many_register_pop_cycles_leave_nothing() {
        let mut reg = Registry::new();
        for i in 0..100_000u32 {
            let id = reg.register(i).unwrap();
            if i % 2 == 0 {
                assert_eq!(reg.pop(id), Some(i));
            } else {
                assert!(reg.pop(id).is_some());
            }
        }
        assert!(reg.is_empty());
    }
}
