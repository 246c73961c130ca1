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
///
/// The bytes of every id live in one buffer shared by both messages' records: an id
/// predicted again is recorded by its place there ([`FrameOrder::keep`]), so a step
/// whose ids were all predicted copies no bytes. Ids that dropped out leave their bytes
/// behind until the buffer is mostly such garbage and is compacted.
pub struct FrameOrder<V> {
    keys: Vec<u8>,
    /// The last message's ids (values taken out as they are matched).
    prev: Vec<Entry<V>>,
    /// This message's ids so far.
    cur: Vec<Entry<V>>,
    /// Bytes of the ids in `cur`.
    cur_bytes: usize,
    /// Where in `prev` the next id is expected.
    cursor: usize,
}

/// An id recorded in a [`FrameOrder`]: where its bytes are in the shared buffer, and its
/// value (taken out when matched: each value lives in one place).
struct Entry<V> {
    start: u32,
    end: u32,
    value: Option<V>,
}

/// A predicted id's value, taken out of the last message's record, with the place of
/// its bytes (to record it again with [`FrameOrder::keep`]).
pub struct Hit<V> {
    pub value: V,
    start: u32,
    end: u32,
}

/// Garbage (bytes of ids no longer recorded) always tolerated before compacting.
const COMPACT_SLACK: usize = 64 * 1024;

impl<V> Default for FrameOrder<V> {
    fn default() -> Self {
        FrameOrder {
            keys: Vec::new(),
            prev: Vec::new(),
            cur: Vec::new(),
            cur_bytes: 0,
            cursor: 0,
        }
    }
}

impl<V> FrameOrder<V> {
    #[inline(always)]
    fn key(&self, e: &Entry<V>) -> &[u8] {
        &self.keys[e.start as usize..e.end as usize]
    }

    /// Starts a message: the ids recorded so far become the prediction, and values of
    /// the previous prediction that were not matched are dropped.
    pub fn start(&mut self) {
        std::mem::swap(&mut self.prev, &mut self.cur);
        self.cur.clear();
        self.cursor = 0;
        let live = std::mem::take(&mut self.cur_bytes);
        if self.keys.len() > 2 * live + COMPACT_SLACK {
            self.compact(live);
        }
    }

    /// Keeps only the bytes of the ids in `prev` (`live` bytes), in their order.
    #[cold]
    fn compact(&mut self, live: usize) {
        let mut keys = Vec::with_capacity(live);
        for e in &mut self.prev {
            let start = keys.len();
            keys.extend_from_slice(&self.keys[e.start as usize..e.end as usize]);
            // Fits: `live` bytes came from a buffer whose offsets fit in u32.
            e.start = start as u32;
            e.end = keys.len() as u32;
        }
        self.keys = keys;
    }

    /// The value recorded for `key` if it is the predicted next id (or the one after:
    /// a request that finished); the caller records it again with [`FrameOrder::keep`].
    #[inline(always)]
    pub fn take_predicted(&mut self, key: &[u8]) -> Option<Hit<V>> {
        let n = self.prev.len();
        let mut i = self.cursor;
        while i < n && i <= self.cursor + 1 {
            let e = &self.prev[i];
            if same_bytes(self.key(e), key) {
                let (start, end) = (e.start, e.end);
                if let Some(value) = self.prev[i].value.take() {
                    self.cursor = i + 1;
                    return Some(Hit { value, start, end });
                }
            }
            i += 1;
        }
        None
    }

    /// Records a predicted id as the next id of this message, its bytes where they are.
    #[inline(always)]
    pub fn keep(&mut self, hit: Hit<V>) {
        self.cur_bytes += (hit.end - hit.start) as usize;
        self.cur.push(Entry {
            start: hit.start,
            end: hit.end,
            value: Some(hit.value),
        });
    }

    /// Records `key` as the next id of this message (keys that would take the shared
    /// buffer to 4 GiB are not recorded: they are never predicted).
    #[inline]
    pub fn push(&mut self, key: &[u8], value: V) {
        let start = self.keys.len();
        let end = start + key.len();
        if end > u32::MAX as usize {
            return;
        }
        self.keys.extend_from_slice(key);
        self.cur_bytes += key.len();
        self.cur.push(Entry {
            start: start as u32,
            end: end as u32,
            value: Some(value),
        });
    }

    /// After a miss: resume predicting after `key`'s place in the last message, if it
    /// is there (requests that joined in between shift the order).
    pub fn resync(&mut self, key: &[u8]) {
        let n = self.prev.len();
        // Look a short way ahead only: a far jump is better left to the hash table.
        for i in self.cursor..n.min(self.cursor + 8) {
            if same_bytes(self.key(&self.prev[i]), key) {
                self.prev[i].value = None;
                self.cursor = i + 1;
                return;
            }
        }
    }

    /// Every id held (recorded for this message, or predicted and not matched yet).
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> {
        let prev = self
            .prev
            .iter()
            .filter(|e| e.value.is_some())
            .map(|e| self.key(e));
        let cur = self.cur.iter().map(|e| self.key(e));
        prev.chain(cur)
    }

    /// Ids recorded for the current message.
    pub fn len(&self) -> usize {
        self.cur.len()
    }

    /// Whether no id was recorded for the current message.
    pub fn is_empty(&self) -> bool {
        self.cur.is_empty()
    }

    /// Bytes held for ids, garbage included (for tests of the compaction bound).
    pub fn key_bytes(&self) -> usize {
        self.keys.len()
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
            let hit = o.take_predicted(id.as_bytes()).expect(id);
            o.keep(hit);
        }
        // "b" finished, "e" joined at the end.
        o.start();
        for (id, v) in [(b"a", 0), (b"c", 2), (b"d", 3)] {
            let hit = o
                .take_predicted(id)
                .expect("predicted (c: skips the finished b)");
            assert_eq!(hit.value, v);
            o.keep(hit);
        }
        assert!(o.take_predicted(b"e").is_none());
        o.push(b"e", 4);
        assert_eq!(o.len(), 4);
        // A value is handed out once: a repeated id in one message is a miss.
        o.start();
        assert_eq!(o.take_predicted(b"a").map(|h| h.value), Some(0));
        assert!(o.take_predicted(b"a").is_none());
        // Resync after a miss in the middle.
        o.resync(b"d");
        assert_eq!(o.take_predicted(b"e").map(|h| h.value), Some(4));
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
    fn frame_order_compacts_the_bytes_of_ids_gone() {
        // Every step, the oldest of 64 running requests finishes and a new one joins:
        // the bytes of finished ids are garbage, which compaction bounds.
        let id = |n: usize| format!("cmpl-{n:040}-0").into_bytes();
        let mut o = FrameOrder::default();
        let mut first = 0;
        for step in 0..20_000 {
            o.start();
            for n in first..first + 64 {
                let key = id(n);
                match o.take_predicted(&key) {
                    Some(hit) => {
                        assert_eq!(hit.value, n, "step {step}");
                        o.keep(hit);
                    }
                    None => {
                        assert!(step == 0 || n == first + 63, "step {step}: {n} missed");
                        o.push(&key, n);
                    }
                }
            }
            let len = id(0).len();
            assert!(
                o.key_bytes() <= 2 * 64 * len + COMPACT_SLACK + len,
                "step {step}"
            );
            first += 1;
        }
        // Held: the last step's 64 ids, and the one that finished at that step (an
        // unmatched prediction, dropped at the next start).
        let last = first - 1;
        let held: Vec<Vec<u8>> = o.keys().map(<[u8]>::to_vec).collect();
        let expected: Vec<Vec<u8>> = (last - 1..last + 64).map(id).collect();
        assert!(held == expected, "held {} ids", held.len());
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
