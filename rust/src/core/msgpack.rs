//! A zero-copy msgpack reader.
//!
//! `Reader` walks a byte slice and hands out borrowed slices for strings, binaries and
//! extension data; it never allocates. Every read checks bounds and reports a typed
//! [`DecodeError`]; nothing here panics on any input. Container lengths are checked
//! against the bytes left (each element takes at least one byte), so a forged length
//! cannot make a caller allocate more than the frame could hold.

use super::error::{DecodeError, DecodeResult, ErrorKind, Kind};

/// msgpack extension type holding raw C-contiguous array bytes.
pub const RAW_VIEW_EXT: i8 = 3;

/// The nil marker byte, tested directly on hot paths.
pub const NIL: u8 = 0xc0;

/// Per marker byte: (encoded length, right shift, mask) of the value within the
/// marker and the 4 bytes after it read big-endian, for positive fixint, uint8,
/// uint16 and uint32; length 0 for every other marker.
static UINT32_FORMS: [(u8, u8, u32); 256] = {
    let mut t = [(0u8, 0u8, 0u32); 256];
    let mut b = 0;
    while b < 0x80 {
        t[b] = (1, 32, 0x7f);
        b += 1;
    }
    t[0xcc] = (2, 24, 0xff);
    t[0xcd] = (3, 16, 0xffff);
    t[0xce] = (5, 0, 0xffff_ffff);
    t
};

/// One msgpack item: a scalar with its value, or a container header with its length.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Item<'a> {
    Nil,
    Bool(bool),
    /// Any msgpack integer; i128 holds the whole [-2**63, 2**64) range.
    Int(i128),
    /// float32 values are widened, as Python does.
    Float(f64),
    /// Raw bytes of a str, not yet checked for UTF-8.
    Str(&'a [u8]),
    Bin(&'a [u8]),
    /// Header of an array with this many elements.
    Array(usize),
    /// Header of a map with this many key/value pairs.
    Map(usize),
    Ext(i8, &'a [u8]),
}

impl Item<'_> {
    /// The family of this item, for error messages.
    pub fn kind(&self) -> Kind {
        match self {
            Item::Nil => Kind::Nil,
            Item::Bool(_) => Kind::Bool,
            Item::Int(_) => Kind::Int,
            Item::Float(_) => Kind::Float,
            Item::Str(_) => Kind::Str,
            Item::Bin(_) => Kind::Bin,
            Item::Array(_) => Kind::Array,
            Item::Map(_) => Kind::Map,
            Item::Ext(..) => Kind::Ext,
        }
    }
}

/// The family of the value starting with marker byte `b` (0xc1 reads as Nil: callers
/// that care have already rejected it through `next_item`).
#[inline]
pub fn kind_of_marker(b: u8) -> Kind {
    match b {
        0x00..=0x7f | 0xe0..=0xff | 0xcc..=0xd3 => Kind::Int,
        0x80..=0x8f | 0xde | 0xdf => Kind::Map,
        0x90..=0x9f | 0xdc | 0xdd => Kind::Array,
        0xa0..=0xbf | 0xd9..=0xdb => Kind::Str,
        0xc2 | 0xc3 => Kind::Bool,
        0xc4..=0xc6 => Kind::Bin,
        0xc7..=0xc9 | 0xd4..=0xd8 => Kind::Ext,
        0xca | 0xcb => Kind::Float,
        0xc0 | 0xc1 => Kind::Nil,
    }
}

/// Checks that `raw` is UTF-8 and returns it as `&str`.
#[inline]
pub fn check_utf8(raw: &[u8]) -> DecodeResult<&str> {
    // ASCII (request ids, dict keys) is by far the common case: skip the full validator.
    if raw.is_ascii() {
        // SAFETY: ASCII is valid UTF-8.
        return Ok(unsafe { std::str::from_utf8_unchecked(raw) });
    }
    std::str::from_utf8(raw).map_err(|_| DecodeError::new(ErrorKind::InvalidUtf8))
}

/// A cursor over one msgpack-encoded buffer.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

#[cold]
#[inline(never)]
fn truncated(offset: usize) -> DecodeError {
    DecodeError::new(ErrorKind::Truncated { offset })
}

#[cold]
#[inline(never)]
fn type_error(expected: &'static str, got: Kind) -> DecodeError {
    DecodeError::new(ErrorKind::Type { expected, got })
}

impl<'a> Reader<'a> {
    /// A reader at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Reader { data, pos: 0 }
    }

    /// Byte offset of the next value.
    #[inline]
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Bytes not read yet.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    /// Fails unless every byte has been read.
    pub fn finish(&self) -> DecodeResult<()> {
        if self.pos == self.data.len() {
            Ok(())
        } else {
            Err(DecodeError::new(ErrorKind::TrailingBytes {
                count: self.remaining(),
                offset: self.pos,
            }))
        }
    }

    /// The next marker byte, not consumed.
    #[inline]
    pub fn peek(&self) -> DecodeResult<u8> {
        match self.data.get(self.pos) {
            Some(&b) => Ok(b),
            None => Err(truncated(self.pos)),
        }
    }

    /// Consumes a nil if one is next; tells whether it did.
    #[inline]
    pub fn take_nil(&mut self) -> bool {
        if self.data.get(self.pos) == Some(&NIL) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// The family of the next value, for error messages (Nil at the end of data).
    pub fn peek_kind(&self) -> Kind {
        self.data
            .get(self.pos)
            .map_or(Kind::Nil, |&b| kind_of_marker(b))
    }

    #[inline]
    fn take(&mut self, n: usize) -> DecodeResult<&'a [u8]> {
        if n > self.remaining() {
            return Err(truncated(self.pos));
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    fn take_array<const N: usize>(&mut self) -> DecodeResult<[u8; N]> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    #[inline]
    fn u8(&mut self) -> DecodeResult<u8> {
        Ok(self.take_array::<1>()?[0])
    }

    #[inline]
    fn u16(&mut self) -> DecodeResult<usize> {
        Ok(u16::from_be_bytes(self.take_array()?) as usize)
    }

    #[inline]
    fn u32(&mut self) -> DecodeResult<usize> {
        Ok(u32::from_be_bytes(self.take_array()?) as usize)
    }

    /// A container length checked against the bytes left: each element needs at least
    /// `min_bytes_each` bytes, so the length can be trusted for allocation.
    #[inline]
    fn container_len(&mut self, len: usize, min_bytes_each: usize) -> DecodeResult<usize> {
        if len.saturating_mul(min_bytes_each) > self.remaining() {
            return Err(truncated(self.pos));
        }
        Ok(len)
    }

    /// Reads the next item (a scalar, or a container header).
    pub fn next_item(&mut self) -> DecodeResult<Item<'a>> {
        let start = self.pos;
        let b = self.u8()?;
        Ok(match b {
            0x00..=0x7f => Item::Int(b as i128),
            0x80..=0x8f => Item::Map(self.container_len((b & 0x0f) as usize, 2)?),
            0x90..=0x9f => Item::Array(self.container_len((b & 0x0f) as usize, 1)?),
            0xa0..=0xbf => Item::Str(self.take((b & 0x1f) as usize)?),
            0xc0 => Item::Nil,
            0xc1 => {
                return Err(DecodeError::new(ErrorKind::InvalidMarker {
                    byte: b,
                    offset: start,
                }))
            }
            0xc2 => Item::Bool(false),
            0xc3 => Item::Bool(true),
            0xc4 => {
                let n = self.u8()? as usize;
                Item::Bin(self.take(n)?)
            }
            0xc5 => {
                let n = self.u16()?;
                Item::Bin(self.take(n)?)
            }
            0xc6 => {
                let n = self.u32()?;
                Item::Bin(self.take(n)?)
            }
            0xc7 => {
                let n = self.u8()? as usize;
                self.ext(n)?
            }
            0xc8 => {
                let n = self.u16()?;
                self.ext(n)?
            }
            0xc9 => {
                let n = self.u32()?;
                self.ext(n)?
            }
            0xca => Item::Float(f32::from_be_bytes(self.take_array()?) as f64),
            0xcb => Item::Float(f64::from_be_bytes(self.take_array()?)),
            0xcc => Item::Int(self.u8()? as i128),
            0xcd => Item::Int(self.u16()? as i128),
            0xce => Item::Int(self.u32()? as i128),
            0xcf => Item::Int(u64::from_be_bytes(self.take_array()?) as i128),
            0xd0 => Item::Int(i8::from_be_bytes(self.take_array()?) as i128),
            0xd1 => Item::Int(i16::from_be_bytes(self.take_array()?) as i128),
            0xd2 => Item::Int(i32::from_be_bytes(self.take_array()?) as i128),
            0xd3 => Item::Int(i64::from_be_bytes(self.take_array()?) as i128),
            0xd4 => self.ext(1)?,
            0xd5 => self.ext(2)?,
            0xd6 => self.ext(4)?,
            0xd7 => self.ext(8)?,
            0xd8 => self.ext(16)?,
            0xd9 => {
                let n = self.u8()? as usize;
                Item::Str(self.take(n)?)
            }
            0xda => {
                let n = self.u16()?;
                Item::Str(self.take(n)?)
            }
            0xdb => {
                let n = self.u32()?;
                Item::Str(self.take(n)?)
            }
            0xdc => {
                let n = self.u16()?;
                Item::Array(self.container_len(n, 1)?)
            }
            0xdd => {
                let n = self.u32()?;
                Item::Array(self.container_len(n, 1)?)
            }
            0xde => {
                let n = self.u16()?;
                Item::Map(self.container_len(n, 2)?)
            }
            0xdf => {
                let n = self.u32()?;
                Item::Map(self.container_len(n, 2)?)
            }
            0xe0..=0xff => Item::Int((b as i8) as i128),
        })
    }

    #[inline]
    fn ext(&mut self, n: usize) -> DecodeResult<Item<'a>> {
        let code = self.u8()? as i8;
        Ok(Item::Ext(code, self.take(n)?))
    }

    /// The bytes of a raw-view extension (type [`RAW_VIEW_EXT`]) in its short forms
    /// (fixext 1..16, ext8: every inline array under 256 bytes), consumed; `None` (nothing
    /// consumed) for anything else, which [`Reader::next_item`] then reads.
    #[inline]
    pub fn small_raw_view(&mut self) -> Option<&'a [u8]> {
        let p = self.pos;
        let (len, code_at) = match *self.data.get(p)? {
            b @ 0xd4..=0xd8 => (1usize << (b - 0xd4), p + 1),
            0xc7 => (*self.data.get(p + 1)? as usize, p + 2),
            _ => return None,
        };
        if *self.data.get(code_at)? as i8 != RAW_VIEW_EXT {
            return None;
        }
        let bytes = self.data.get(code_at + 1..code_at + 1 + len)?;
        self.pos = code_at + 1 + len;
        Some(bytes)
    }

    /// Reads an array header; `expected` names the wanted type in the error.
    #[inline]
    pub fn array_len(&mut self, expected: &'static str) -> DecodeResult<usize> {
        let b = self.peek()?;
        if (0x90..=0x9f).contains(&b) {
            self.pos += 1;
            return self.container_len((b & 0x0f) as usize, 1);
        }
        self.array_len_slow(expected)
    }

    #[inline(never)]
    fn array_len_slow(&mut self, expected: &'static str) -> DecodeResult<usize> {
        let save = self.pos;
        match self.next_item()? {
            Item::Array(n) => Ok(n),
            other => {
                self.pos = save;
                Err(type_error(expected, other.kind()))
            }
        }
    }

    /// Reads a map header; `expected` names the wanted type in the error.
    #[inline]
    pub fn map_len(&mut self, expected: &'static str) -> DecodeResult<usize> {
        let b = self.peek()?;
        if (0x80..=0x8f).contains(&b) {
            self.pos += 1;
            return self.container_len((b & 0x0f) as usize, 2);
        }
        let save = self.pos;
        match self.next_item()? {
            Item::Map(n) => Ok(n),
            other => {
                self.pos = save;
                Err(type_error(expected, other.kind()))
            }
        }
    }

    /// Reads the raw (unchecked) bytes of a str.
    #[inline(always)]
    pub fn str_bytes(&mut self) -> DecodeResult<&'a [u8]> {
        let b = self.peek()?;
        if (0xa0..=0xbf).contains(&b) {
            self.pos += 1;
            return self.take((b & 0x1f) as usize);
        }
        // str8: request ids of 32..255 bytes ("cmpl-<uuid>-0" is 43).
        if b == 0xd9 {
            if let Some(&n) = self.data.get(self.pos + 1) {
                self.pos += 2;
                return self.take(n as usize);
            }
        }
        self.str_bytes_slow()
    }

    #[inline(never)]
    fn str_bytes_slow(&mut self) -> DecodeResult<&'a [u8]> {
        let save = self.pos;
        match self.next_item()? {
            Item::Str(s) => Ok(s),
            other => {
                self.pos = save;
                Err(type_error("str", other.kind()))
            }
        }
    }

    /// Reads a str and checks it is UTF-8.
    #[inline(always)]
    pub fn str(&mut self) -> DecodeResult<&'a str> {
        check_utf8(self.str_bytes()?)
    }

    /// Reads any msgpack integer (bools are not integers).
    #[inline]
    pub fn int(&mut self) -> DecodeResult<i128> {
        let b = self.peek()?;
        if b <= 0x7f {
            self.pos += 1;
            return Ok(b as i128);
        }
        // Token ids: uint8/16/32 cover every vocabulary.
        let rest = &self.data[self.pos + 1..];
        match b {
            0xcc if !rest.is_empty() => {
                self.pos += 2;
                return Ok(rest[0] as i128);
            }
            0xcd if rest.len() >= 2 => {
                self.pos += 3;
                return Ok(u16::from_be_bytes([rest[0], rest[1]]) as i128);
            }
            0xce if rest.len() >= 4 => {
                self.pos += 5;
                return Ok(u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as i128);
            }
            _ => {}
        }
        self.int_slow()
    }

    /// Reads an integer like [`Reader::int`], with a fast path for the unsigned forms
    /// token ids take (positive fixint, uint8, uint16, uint32) that has no branch on
    /// which of them it is: ids of a large vocabulary mix uint16 and uint32 at random,
    /// and a mispredicted branch per id costs more than the rest of its parsing.
    #[inline]
    pub fn uint32_or_int(&mut self) -> DecodeResult<i128> {
        let p = self.pos;
        if let Some(w) = self.data.get(p..p + 5) {
            let (len, shift, mask) = UINT32_FORMS[w[0] as usize];
            if len != 0 {
                let x = u64::from_be_bytes([0, 0, 0, w[0], w[1], w[2], w[3], w[4]]);
                self.pos = p + len as usize;
                return Ok(((x >> shift) as u32 & mask) as i128);
            }
        }
        self.int()
    }

    #[inline(never)]
    fn int_slow(&mut self) -> DecodeResult<i128> {
        let save = self.pos;
        match self.next_item()? {
            Item::Int(v) => Ok(v),
            other => {
                self.pos = save;
                Err(type_error("int", other.kind()))
            }
        }
    }

    /// Reads a bool.
    #[inline]
    pub fn bool(&mut self) -> DecodeResult<bool> {
        let save = self.pos;
        match self.next_item()? {
            Item::Bool(v) => Ok(v),
            other => {
                self.pos = save;
                Err(type_error("bool", other.kind()))
            }
        }
    }

    /// Reads a float; integers are accepted and converted, as msgspec does for `float`.
    #[inline]
    pub fn float(&mut self) -> DecodeResult<f64> {
        let save = self.pos;
        match self.next_item()? {
            Item::Float(v) => Ok(v),
            Item::Int(v) => Ok(v as f64),
            other => {
                self.pos = save;
                Err(type_error("float", other.kind()))
            }
        }
    }

    /// Skips one complete value of any shape, without recursion (so no depth limit is
    /// needed) and without checking strings or extension types: skipped values are
    /// fields this decoder does not know, which must only be well-formed msgpack.
    pub fn skip(&mut self) -> DecodeResult<()> {
        // Values still to skip; container lengths were checked against the bytes left,
        // so this cannot overflow.
        let mut pending: usize = 1;
        while pending > 0 {
            pending -= 1;
            match self.next_item()? {
                Item::Array(n) => pending += n,
                Item::Map(n) => pending += 2 * n,
                _ => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(bytes: &[u8]) -> DecodeResult<Item<'_>> {
        Reader::new(bytes).next_item()
    }

    #[test]
    fn scalars_of_every_width() {
        assert_eq!(item(&[0x05]).unwrap(), Item::Int(5));
        assert_eq!(item(&[0xff]).unwrap(), Item::Int(-1));
        assert_eq!(item(&[0xe0]).unwrap(), Item::Int(-32));
        assert_eq!(item(&[0xcc, 0xff]).unwrap(), Item::Int(255));
        assert_eq!(item(&[0xcd, 0x01, 0x00]).unwrap(), Item::Int(256));
        assert_eq!(item(&[0xce, 0, 1, 0, 0]).unwrap(), Item::Int(65536));
        assert_eq!(
            item(&[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]).unwrap(),
            Item::Int(u64::MAX as i128)
        );
        assert_eq!(item(&[0xd0, 0x80]).unwrap(), Item::Int(-128));
        assert_eq!(item(&[0xd1, 0x80, 0x00]).unwrap(), Item::Int(-32768));
        assert_eq!(
            item(&[0xd2, 0x80, 0, 0, 0]).unwrap(),
            Item::Int(i32::MIN as i128)
        );
        assert_eq!(
            item(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]).unwrap(),
            Item::Int(i64::MIN as i128)
        );
        assert_eq!(item(&[0xc0]).unwrap(), Item::Nil);
        assert_eq!(item(&[0xc2]).unwrap(), Item::Bool(false));
        assert_eq!(item(&[0xc3]).unwrap(), Item::Bool(true));
        assert_eq!(
            item(&[0xca, 0x3f, 0xc0, 0, 0]).unwrap(),
            Item::Float(1.5),
            "float32 widens"
        );
        let mut f64b = vec![0xcb];
        f64b.extend_from_slice(&0.1f64.to_be_bytes());
        assert_eq!(item(&f64b).unwrap(), Item::Float(0.1));
    }

    #[test]
    fn uint32_fast_path_reads_what_int_reads() {
        // Every marker, with every following byte pattern that matters, with and
        // without enough bytes left for the fast path: same value (or error) and the
        // same position as the general reader.
        let tails: [&[u8]; 4] = [
            &[0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0],
            &[0xff; 8],
            &[0; 8],
            &[0x80, 0x01, 0x7f, 0xfe, 0x00, 0xa5, 0x5a, 0xc3],
        ];
        for marker in 0..=0xffu8 {
            for tail in tails {
                for len in 0..=tail.len() {
                    let bytes = [&[marker][..], &tail[..len]].concat();
                    let mut fast = Reader::new(&bytes);
                    let mut slow = Reader::new(&bytes);
                    let got = fast.uint32_or_int();
                    let want = slow.int();
                    assert_eq!(got.as_ref().ok(), want.as_ref().ok(), "{bytes:02x?}");
                    assert_eq!(got.is_err(), want.is_err(), "{bytes:02x?}");
                    assert_eq!(fast.pos, slow.pos, "{bytes:02x?}");
                }
            }
        }
        let mut r = Reader::new(&[0xce, 0, 2, 0x4d, 0x18, 0x7f, 0xcd, 0x01, 0x00, 0xc0]);
        assert_eq!(r.uint32_or_int().unwrap(), 150_808);
        assert_eq!(r.uint32_or_int().unwrap(), 127);
        assert_eq!(r.uint32_or_int().unwrap(), 256, "short tail: general path");
        assert!(r.uint32_or_int().is_err());
    }

    #[test]
    fn small_raw_view_reads_what_next_item_reads() {
        // fixext 1..16 and ext8 of type 3: the same bytes and position as the general
        // reader; other types, other forms and truncated data: nothing consumed.
        let mut cases: Vec<Vec<u8>> = Vec::new();
        for (marker, len) in [
            (0xd4u8, 1usize),
            (0xd5, 2),
            (0xd6, 4),
            (0xd7, 8),
            (0xd8, 16),
        ] {
            cases.push([&[marker, 3][..], &vec![0xab; len], &[0xc0]].concat());
        }
        for len in [0usize, 1, 24, 255] {
            cases.push([&[0xc7, len as u8, 3][..], &vec![0x5a; len], &[0x01]].concat());
        }
        for bytes in &cases {
            let mut fast = Reader::new(bytes);
            let mut slow = Reader::new(bytes);
            let got = fast.small_raw_view().expect("a raw view");
            assert_eq!(slow.next_item().unwrap(), Item::Ext(RAW_VIEW_EXT, got));
            assert_eq!(fast.pos, slow.pos);
        }
        let others: [&[u8]; 7] = [
            &[0xd6, 4, 0, 0, 0, 0],
            &[0xc7, 2, 1, 0, 0],
            &[0xc8, 0, 2, 3, 0, 0],
            &[0x05],
            &[0xc7, 24, 3, 0],
            &[0xd7, 3, 0],
            &[0xc7],
        ];
        for bytes in others {
            let mut r = Reader::new(bytes);
            assert_eq!(r.small_raw_view(), None, "{bytes:02x?}");
            assert_eq!(r.pos, 0);
        }
    }

    #[test]
    fn strings_bins_exts() {
        assert_eq!(item(b"\xa3abc").unwrap(), Item::Str(b"abc"));
        assert_eq!(item(b"\xd9\x02hi").unwrap(), Item::Str(b"hi"));
        assert_eq!(item(b"\xda\x00\x01x").unwrap(), Item::Str(b"x"));
        assert_eq!(item(b"\xdb\x00\x00\x00\x01y").unwrap(), Item::Str(b"y"));
        assert_eq!(item(b"\xc4\x01z").unwrap(), Item::Bin(b"z"));
        assert_eq!(item(b"\xc5\x00\x00").unwrap(), Item::Bin(b""));
        assert_eq!(item(b"\xc6\x00\x00\x00\x02ab").unwrap(), Item::Bin(b"ab"));
        assert_eq!(item(b"\xd4\x03a").unwrap(), Item::Ext(3, b"a"));
        assert_eq!(item(b"\xd5\x03ab").unwrap(), Item::Ext(3, b"ab"));
        assert_eq!(item(b"\xd6\x03abcd").unwrap(), Item::Ext(3, b"abcd"));
        assert_eq!(
            item(b"\xd7\xffabcdefgh").unwrap(),
            Item::Ext(-1, b"abcdefgh")
        );
        assert_eq!(
            item(&[&[0xd8u8, 3][..], &[7u8; 16]].concat()).unwrap(),
            Item::Ext(3, &[7u8; 16])
        );
        assert_eq!(item(b"\xc7\x00\x03").unwrap(), Item::Ext(3, b""));
        assert_eq!(item(b"\xc8\x00\x01\x03q").unwrap(), Item::Ext(3, b"q"));
        assert_eq!(
            item(b"\xc9\x00\x00\x00\x01\x03q").unwrap(),
            Item::Ext(3, b"q")
        );
    }

    #[test]
    fn containers() {
        assert_eq!(item(b"\x92\x01\x02").unwrap(), Item::Array(2));
        assert_eq!(item(b"\xdc\x00\x01\x01").unwrap(), Item::Array(1));
        assert_eq!(item(b"\xdd\x00\x00\x00\x00").unwrap(), Item::Array(0));
        assert_eq!(item(b"\x81\x01\x02").unwrap(), Item::Map(1));
        assert_eq!(item(b"\xde\x00\x01\x01\x02").unwrap(), Item::Map(1));
        assert_eq!(item(b"\xdf\x00\x00\x00\x00").unwrap(), Item::Map(0));
    }

    #[test]
    fn forged_lengths_are_truncation_not_allocation() {
        // array32 claiming 4 billion elements in a 5-byte buffer.
        let err = item(b"\xdd\xff\xff\xff\xff").unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::Truncated { .. }));
        let err = item(b"\xdf\xff\xff\xff\xff\x01").unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::Truncated { .. }));
        let err = item(b"\xdb\xff\xff\xff\xffabc").unwrap_err();
        assert!(matches!(err.kind(), ErrorKind::Truncated { .. }));
        // A fixmap needs two bytes per entry.
        assert!(item(b"\x82\x01\x02\x03").is_err());
    }

    #[test]
    fn every_truncation_point_errors() {
        let full: &[u8] =
            b"\x93\xcf\x00\x00\x00\x00\x00\x00\x00\x01\xa2hi\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00";
        let mut r = Reader::new(full);
        r.skip().unwrap();
        r.finish().unwrap();
        for cut in 0..full.len() {
            let mut r = Reader::new(&full[..cut]);
            let err = r.skip().unwrap_err();
            assert!(
                matches!(err.kind(), ErrorKind::Truncated { .. }),
                "cut {cut}: {err}"
            );
        }
    }

    #[test]
    fn invalid_marker() {
        let err = item(b"\xc1").unwrap_err();
        assert_eq!(
            err.kind(),
            &ErrorKind::InvalidMarker {
                byte: 0xc1,
                offset: 0
            }
        );
        assert!(err.to_string().contains("not msgpack"));
    }

    #[test]
    fn typed_reads_report_expected_and_got() {
        let mut r = Reader::new(b"\xa1x");
        let err = r.int().unwrap_err();
        assert_eq!(
            err.kind(),
            &ErrorKind::Type {
                expected: "int",
                got: Kind::Str
            }
        );
        // A failed typed read does not consume the value.
        assert_eq!(r.str().unwrap(), "x");
        let mut r = Reader::new(b"\xc3");
        assert!(r.int().is_err(), "bool is not an int");
        assert!(r.float().is_err(), "bool is not a float");
        let mut r = Reader::new(b"\x07");
        assert_eq!(r.float().unwrap(), 7.0, "int widens to float");
        let mut r = Reader::new(b"\x90");
        assert!(r.map_len("map").is_err());
        assert_eq!(r.array_len("array").unwrap(), 0);
        let mut r = Reader::new(b"\x80");
        assert!(r.array_len("array").is_err());
        assert!(r.str_bytes().is_err());
        assert_eq!(r.map_len("map").unwrap(), 0);
    }

    #[test]
    fn utf8() {
        assert_eq!(Reader::new("\u{a5}\u{e9}".as_bytes()).position(), 0);
        let mut enc = vec![0xa0 | 5];
        enc.extend_from_slice("h\u{e9}é".as_bytes());
        let mut r = Reader::new(&enc);
        assert_eq!(r.str().unwrap(), "h\u{e9}é");
        let mut r = Reader::new(b"\xa2\xff\xfe");
        assert_eq!(r.str().unwrap_err().kind(), &ErrorKind::InvalidUtf8);
        // Overlong / surrogate encodings are rejected too.
        let mut r = Reader::new(b"\xa3\xed\xa0\x80");
        assert_eq!(r.str().unwrap_err().kind(), &ErrorKind::InvalidUtf8);
    }

    #[test]
    fn skip_nested_without_recursion() {
        // 100,000 nested single-element arrays around a nil: no stack growth.
        let mut deep = vec![0x91u8; 100_000];
        deep.push(0xc0);
        let mut r = Reader::new(&deep);
        r.skip().unwrap();
        r.finish().unwrap();
    }

    #[test]
    fn trailing_bytes() {
        let mut r = Reader::new(b"\xc0\x01\x02");
        r.skip().unwrap();
        let err = r.finish().unwrap_err();
        assert_eq!(
            err.kind(),
            &ErrorKind::TrailingBytes {
                count: 2,
                offset: 1
            }
        );
    }

    #[test]
    fn take_nil_and_peek() {
        let mut r = Reader::new(b"\xc0\x01");
        assert!(r.take_nil());
        assert!(!r.take_nil());
        assert_eq!(r.peek_kind(), Kind::Int);
        assert_eq!(r.int().unwrap(), 1);
        assert!(matches!(
            r.peek().unwrap_err().kind(),
            ErrorKind::Truncated { offset: 2 }
        ));
    }
}
