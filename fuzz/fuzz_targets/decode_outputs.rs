//! Fuzzes the PyO3-free frame decoder: any bytes, split into a payload and aux frames,
//! must decode or fail with a `DecodeError`, never panic, hang or overflow the stack.
//!
//! The first input byte says how many aux frames follow the payload (0-3); each aux
//! frame is then a length byte and that many bytes. Run with
//! `cargo fuzz run decode_outputs` (needs a nightly toolchain or RUSTC_BOOTSTRAP=1).

#![no_main]

use _native::core::msgpack::Reader;
use _native::core::schema::{decode_outputs_for, Scratch};
use _native::core::tree::TreeBuilder;
use _native::core::wire::Protocol;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&head, mut rest)) = data.split_first() else {
        return;
    };
    let mut aux: Vec<&[u8]> = Vec::new();
    for _ in 0..(head % 4) {
        let Some((&len, tail)) = rest.split_first() else {
            break;
        };
        let len = (len as usize).min(tail.len());
        aux.push(&tail[..len]);
        rest = &tail[len..];
    }
    let mut frames: Vec<&[u8]> = vec![rest];
    frames.extend(aux);

    // The reader alone: skipping any value terminates without recursion.
    let mut reader = Reader::new(rest);
    let _ = reader.skip();

    // The full schema walk, in every protocol version.
    let mut scratch = Scratch::default();
    for protocol in Protocol::ALL {
        let mut builder = TreeBuilder::new(&frames);
        if let Ok(tree) = decode_outputs_for(protocol, &frames, &mut builder, &mut scratch) {
            // A decoded message re-decodes to the same value (the walk is deterministic).
            let mut again = TreeBuilder::new(&frames);
            let second = decode_outputs_for(protocol, &frames, &mut again, &mut scratch);
            assert_eq!(Ok(tree), second);
        }
    }
});
