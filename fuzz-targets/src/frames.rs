//! Splitting fuzz input into several protobuf messages, the way a stream of
//! them arrives: each one length-delimited, decoded by prost.

use prost::Message;

/// Decodes length-delimited messages from `data` until it runs out or one
/// does not decode; what decoded so far is kept, like the messages a
/// stream delivered before a bad one.
pub(crate) fn messages<M: Message + Default>(mut data: &[u8]) -> Vec<M> {
    let mut out = Vec::new();
    while !data.is_empty() {
        match M::decode_length_delimited(&mut data) {
            Ok(m) => out.push(m),
            Err(_) => break,
        }
    }
    out
}

/// The inverse of [`messages`], for seeds.
pub(crate) fn encode<M: Message>(ms: &[M]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in ms {
        m.encode_length_delimited(&mut out)
            .expect("a Vec grows as needed");
    }
    out
}

/// Messages as a gRPC request body: per message a compression flag, a
/// big-endian length, the message.
pub(crate) fn grpc_body<M: Message>(ms: &[M]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in ms {
        let bytes = m.encode_to_vec();
        out.push(0);
        out.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
        out.extend_from_slice(&bytes);
    }
    out
}

/// Splits off the first byte, which targets read as options.
pub(crate) fn options(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&o, rest)) => (o, rest),
        None => (0, data),
    }
}
