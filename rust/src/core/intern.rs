//! A bounded intern cache keyed by bytes.
//!
//! The decoder maps each request id's bytes to one string object, so the same id decodes
//! to the same object frame after frame (the front-end's dict lookups then hit a cached
//! hash) and known ids skip UTF-8 checking and string allocation.
//!
//! Bounded with two generations: lookups hit `current` first, then `previous` (and a hit
//! there moves the entry back to `current`). When `current` holds a generation's worth
//! of entries, `previous` is dropped and `current` becomes `previous`. An id seen at
//! least once per generation (every live request) therefore stays; ids of finished
//! requests age out within two generations. At most `capacity` entries are ever held.
//!
//! The tables are small open-addressing tables that keep each key's full hash next to
//! it, so a probe compares bytes only on a real match; the hash is a seeded
//! multiply-fold over 16 bytes per step (request ids are ~40 bytes: three steps).

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;

const K0: u64 = 0x243f_6a88_85a3_08d3;
const K1: u64 = 0x1319_8a2e_0370_7344;
const K2: u64 = 0xa409_3822_299f_31d0;
const K3: u64 = 0x082e_fa98_ec4e_6c89;

#[inline(always)]
fn fold(a: u64, b: u64) -> u64 {
    let r = (a as u128).wrapping_mul(b as u128);
    (r as u64) ^ ((r >> 64) as u64)
}

#[inline(always)]
fn read8(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

#[inline(always)]
fn read4(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w) as u64
}

/// Seeded hash of a byte string.
#[inline]
pub fn hash_bytes(seed: u64, b: &[u8]) -> u64 {
    let len = b.len();
    let mut s = seed ^ (len as u64).wrapping_mul(K0);
    if len <= 16 {
        let (lo, hi) = if len >= 8 {
            (read8(b, 0), read8(b, len - 8))
        } else if len >= 4 {
            (read4(b, 0), read4(b, len - 4))
        } else if len > 0 {
            let v = b[0] as u64 | (b[len / 2] as u64) << 8 | (b[len - 1] as u64) << 16;
            (v, 0)
        } else {
            (0, 0)
        };
        s = fold(lo ^ s, hi ^ K1);
    } else {
        let mut i = 0;
        while i + 16 < len {
            s = fold(read8(b, i) ^ s, read8(b, i + 8) ^ K1);
            i += 16;
        }
        s = fold(read8(b, len - 16) ^ s, read8(b, len - 8) ^ K2);
    }
    fold(s, K3)
}

/// Byte equality without a libc call: keys are short and usually equal when compared.
#[inline(always)]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let len = a.len();
    if len < 8 {
        return a == b;
    }
    let mut i = 0;
    while i + 8 <= len {
        if read8(a, i) != read8(b, i) {
            return false;
        }
        i += 8;
    }
    read8(a, len - 8) == read8(b, len - 8)
}

enum Slot<V> {
    Empty,
    /// A promoted entry's old place: lookups probe past it.
    Moved,
    Full {
        hash: u64,
        key: Box<[u8]>,
        value: V,
    },
}

/// Open addressing with linear probing; never more than half full.
struct Table<V> {
    slots: Vec<Slot<V>>,
    len: usize,
}

impl<V> Table<V> {
    fn new(slots: usize) -> Self {
        Table {
            slots: (0..slots).map(|_| Slot::Empty).collect(),
            len: 0,
        }
    }

    #[inline]
    fn find(&self, hash: u64, key: &[u8]) -> Option<usize> {
        let mask = self.slots.len() - 1;
        let mut i = hash as usize & mask;
        loop {
            match &self.slots[i] {
                Slot::Empty => return None,
                Slot::Full {
                    hash: h, key: k, ..
                } if *h == hash && same_bytes(k, key) => return Some(i),
                _ => i = (i + 1) & mask,
            }
        }
    }

    fn insert_new(&mut self, hash: u64, key: Box<[u8]>, value: V) -> usize {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let mask = self.slots.len() - 1;
        let mut i = hash as usize & mask;
        while !matches!(self.slots[i], Slot::Empty) {
            i = (i + 1) & mask;
        }
        self.slots[i] = Slot::Full { hash, key, value };
        self.len += 1;
        i
    }

    fn grow(&mut self) {
        let old = std::mem::replace(self, Table::new(self.slots.len() * 2));
        for slot in old.slots {
            if let Slot::Full { hash, key, value } = slot {
                self.insert_new(hash, key, value);
            }
        }
    }
}

/// Maps byte strings to values, holding at most `capacity` entries.
pub struct InternCache<V> {
    current: Table<V>,
    previous: Table<V>,
    generation: usize,
    seed: u64,
    max_key_len: usize,
    rotations: u64,
}

const INITIAL_SLOTS: usize = 256;

impl<V> InternCache<V> {
    /// Longest key worth caching by default; longer ids are built every time.
    pub const DEFAULT_MAX_KEY_LEN: usize = 256;

    /// A cache of at most `capacity` entries (at least 2).
    pub fn new(capacity: usize) -> Self {
        InternCache {
            current: Table::new(INITIAL_SLOTS),
            previous: Table::new(1),
            generation: (capacity / 2).max(1),
            seed: RandomState::new().hash_one(0x636f_7265_7769_7265u64),
            max_key_len: Self::DEFAULT_MAX_KEY_LEN,
            rotations: 0,
        }
    }

    /// Sets the longest key worth caching (longer keys are never cached).
    pub fn set_max_key_len(&mut self, max_key_len: usize) {
        self.max_key_len = max_key_len;
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.current.len + self.previous.len
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
        let hash = hash_bytes(self.seed, key);
        match self.current.find(hash, key) {
            Some(i) => match &self.current.slots[i] {
                Slot::Full { value, .. } => Some(value),
                _ => None,
            },
            None => self.promote(hash, key),
        }
    }

    #[inline(never)]
    fn promote(&mut self, hash: u64, key: &[u8]) -> Option<&V> {
        if self.previous.len == 0 {
            return None;
        }
        let i = self.previous.find(hash, key)?;
        let Slot::Full { key, value, .. } =
            std::mem::replace(&mut self.previous.slots[i], Slot::Moved)
        else {
            return None;
        };
        self.previous.len -= 1;
        self.make_room();
        let at = self.current.insert_new(hash, key, value);
        match &self.current.slots[at] {
            Slot::Full { value, .. } => Some(value),
            _ => None,
        }
    }

    fn make_room(&mut self) {
        if self.current.len >= self.generation {
            self.previous = std::mem::replace(&mut self.current, Table::new(INITIAL_SLOTS));
            self.rotations += 1;
        }
    }

    /// How many times a generation was retired. Entries not looked up since the
    /// previous rotation are dropped at the next one: a user that keeps ids alive by
    /// other means (like [`FrameOrder`]) looks them up again when this changes.
    pub fn rotations(&self) -> u64 {
        self.rotations
    }

    /// Caches `value` for `key` (not known yet; keys longer than the limit are not
    /// cached) and returns the cached value.
    pub fn insert(&mut self, key: &[u8], value: V) -> Option<&V> {
        if key.len() > self.max_key_len {
            return None;
        }
        let hash = hash_bytes(self.seed, key);
        self.make_room();
        let at = self.current.insert_new(hash, key.into(), value);
        match &self.current.slots[at] {
            Slot::Full { value, .. } => Some(value),
            _ => None,
        }
    }
}

/// The ids of the last message from one engine, in order, to predict the next one's.
///
/// An engine reports its running requests in the same order step after step (new ones
/// join at the end, finished ones drop out), so the id at position `i` of a message is
/// almost always the one just after the previous match in the last message. A
/// prediction costs one comparison with bytes read sequentially, instead of a hash and
/// a table probe; ids it misses go through [`InternCache`].
pub struct FrameOrder<V> {
    prev: Order<V>,
    cur: Order<V>,
    /// Where in `prev` the next id is expected.
    cursor: usize,
}

struct Order<V> {
    keys: Vec<u8>,
    /// Per id: where its key starts and ends in `keys`, and its value (taken out when
    /// matched: each value lives in one place).
    entries: Vec<(u32, u32, Option<V>)>,
}

impl<V> Order<V> {
    fn new() -> Self {
        Order {
            keys: Vec::new(),
            entries: Vec::new(),
        }
    }

    fn clear(&mut self) {
        self.keys.clear();
        self.entries.clear();
    }

    #[inline]
    fn key(&self, i: usize) -> &[u8] {
        let (start, end, _) = self.entries[i];
        &self.keys[start as usize..end as usize]
    }
}

impl<V> Default for FrameOrder<V> {
    fn default() -> Self {
        FrameOrder {
            prev: Order::new(),
            cur: Order::new(),
            cursor: 0,
        }
    }
}

impl<V> FrameOrder<V> {
    /// Starts a message: the ids recorded so far become the prediction, and values of
    /// the previous prediction that were not matched are dropped.
    pub fn start(&mut self) {
        std::mem::swap(&mut self.prev, &mut self.cur);
        self.cur.clear();
        self.cursor = 0;
    }

    /// The value recorded for `key` if it is the predicted next id (or the one after:
    /// a request that finished); the caller records it again with [`FrameOrder::push`].
    #[inline(always)]
    pub fn take_predicted(&mut self, key: &[u8]) -> Option<V> {
        let n = self.prev.entries.len();
        let mut i = self.cursor;
        while i < n && i <= self.cursor + 1 {
            if same_bytes(self.prev.key(i), key) {
                if let Some(v) = self.prev.entries[i].2.take() {
                    self.cursor = i + 1;
                    return Some(v);
                }
            }
            i += 1;
        }
        None
    }

    /// Records `key` as the next id of this message (keys of 4 GiB and more are not
    /// recorded: they are never predicted).
    #[inline]
    pub fn push(&mut self, key: &[u8], value: V) {
        let start = self.cur.keys.len();
        let end = start + key.len();
        if end > u32::MAX as usize {
            return;
        }
        self.cur.keys.extend_from_slice(key);
        self.cur
            .entries
            .push((start as u32, end as u32, Some(value)));
    }

    /// After a miss: resume predicting after `key`'s place in the last message, if it
    /// is there (requests that joined in between shift the order).
    pub fn resync(&mut self, key: &[u8]) {
        let n = self.prev.entries.len();
        // Look a short way ahead only: a far jump is better left to the hash table.
        for i in self.cursor..n.min(self.cursor + 8) {
            if same_bytes(self.prev.key(i), key) {
                self.prev.entries[i].2 = None;
                self.cursor = i + 1;
                return;
            }
        }
    }

    /// Every id held (recorded for this message, or predicted and not matched yet).
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        let prev = (0..self.prev.entries.len())
            .filter(|&i| self.prev.entries[i].2.is_some())
            .map(|i| self.prev.key(i));
        let cur = (0..self.cur.entries.len()).map(|i| self.cur.key(i));
        prev.chain(cur)
    }

    /// Ids recorded for the current message.
    pub fn len(&self) -> usize {
        self.cur.entries.len()
    }

    /// Whether no id was recorded for the current message.
    pub fn is_empty(&self) -> bool {
        self.cur.entries.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_order_predicts_stable_orders() {
        let mut o = FrameOrder::default();
        o.start();
        for (i, id) in ["a", "b", "c", "d"].iter().enumerate() {
            assert!(o.take_predicted(id.as_bytes()).is_none());
            o.push(id.as_bytes(), i);
        }
        // Same order: every id predicted.
        o.start();
        for id in ["a", "b", "c", "d"] {
            let v = o.take_predicted(id.as_bytes()).expect(id);
            o.push(id.as_bytes(), v);
        }
        // "b" finished, "e" joined at the end.
        o.start();
        assert_eq!(o.take_predicted(b"a"), Some(0));
        o.push(b"a", 0);
        assert_eq!(o.take_predicted(b"c"), Some(2), "skips the finished id");
        o.push(b"c", 2);
        assert_eq!(o.take_predicted(b"d"), Some(3));
        o.push(b"d", 3);
        assert_eq!(o.take_predicted(b"e"), None);
        o.push(b"e", 4);
        assert_eq!(o.len(), 4);
        // A value is handed out once: a repeated id in one message is a miss.
        o.start();
        assert_eq!(o.take_predicted(b"a"), Some(0));
        assert_eq!(o.take_predicted(b"a"), None);
        // Resync after a miss in the middle.
        o.resync(b"d");
        assert_eq!(o.take_predicted(b"e"), Some(4));
        assert!(o.is_empty(), "nothing pushed for this message yet");
        // Held ids: the unmatched predictions ("c"; "a", "d", "e" were taken).
        assert_eq!(o.keys().collect::<Vec<_>>(), vec![b"c".as_slice()]);
        o.push(b"z", 9);
        assert_eq!(
            o.keys().collect::<Vec<_>>(),
            vec![b"c".as_slice(), b"z".as_slice()]
        );
    }

    #[test]
    fn rotations_count_retired_generations() {
        let mut c = InternCache::new(4);
        for i in 0..10u8 {
            c.insert(&[i], i);
        }
        assert_eq!(
            c.rotations(),
            4,
            "a generation of 2 retired every 2 inserts"
        );
    }

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
        // Old keys aged out; recent ones are still there.
        assert!(c.get(b"cmpl-0").is_none());
        assert_eq!(c.get(b"cmpl-9999"), Some(&9999));
    }

    #[test]
    fn many_keys_of_every_length() {
        let mut c = InternCache::new(1 << 16);
        let keys: Vec<Vec<u8>> = (0..5000u32)
            .map(|i| {
                let len = (i % 70) as usize;
                (0..len).map(|j| (i as usize * 31 + j * 7) as u8).collect()
            })
            .collect();
        for (i, k) in keys.iter().enumerate() {
            if c.get(k).is_none() {
                c.insert(k, i);
            }
        }
        for k in &keys {
            let v = *c.get(k).unwrap();
            assert_eq!(keys[v], *k);
        }
    }

    #[test]
    fn long_keys_are_not_cached() {
        let mut c = InternCache::new(8);
        let long = vec![b'x'; 1000];
        assert!(c.insert(&long, 1).is_none());
        assert!(c.get(&long).is_none());
    }

    #[test]
    fn hash_separates_lengths_and_seeds() {
        assert_ne!(hash_bytes(1, b"a"), hash_bytes(1, b"a\0"));
        assert_ne!(hash_bytes(1, b""), hash_bytes(1, b"\0"));
        assert_ne!(hash_bytes(1, b"same"), hash_bytes(2, b"same"));
        let a = b"cmpl-0123456789abcdef0123456789abcdef-0";
        let mut b = *a;
        b[20] ^= 1;
        assert_ne!(hash_bytes(7, a), hash_bytes(7, &b));
    }
}
