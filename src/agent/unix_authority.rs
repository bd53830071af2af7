//! Kubelet's plugin watcher dials a registration socket with its path as the
//! gRPC target and no authority override, so every request it sends carries
//! the path, percent-encoded, as the HTTP/2 `:authority`
//! (`%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2F…`; seen on kubelet 1.36).
//! The HTTP/2 server under tonic (h2, with the `http` crate's URI rules)
//! refuses such a request with `PROTOCOL_ERROR`, and kubelet never learns of
//! the plugin. Go servers do not check the authority, so kubelet was never
//! fixed (its device plugin and CSI clients were, in 1.26, by sending
//! `localhost`).
//!
//! [`LocalhostAuthority`] sits between the socket and the server and does what
//! those fixed clients do: it rewrites the `:authority` of each request kubelet
//! sends to `localhost`, leaving every other byte as it came.
//!
//! Only the client's header blocks are touched, and only an `:authority`
//! field sent as a literal with the static table's name (index 1), which is
//! how Go's HPACK encoder sends it. The value is replaced by a shorter one
//! without Huffman coding; when the field is also added to the dynamic table,
//! the server's copy of the entry is smaller than the client's, so the server
//! evicts no later than the client does and every index the client sends
//! still names the same entry. Anything not understood (a header block split
//! over CONTINUATION frames, a malformed frame) is passed through unchanged.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What every HTTP/2 connection opens with.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The static table's index of `:authority`.
const AUTHORITY_INDEX: u64 = 1;
const LOCALHOST: &[u8] = b"localhost";
/// Frames longer than this are not HTTP/2 as a server would accept it
/// (2^24 - 1); stop parsing and pass everything through.
const MAX_FRAME: usize = (1 << 24) - 1;

enum State {
    Preface,
    Frames,
    /// Something was not understood: pass the rest through unchanged.
    Passthrough,
}

/// A connection whose incoming requests get `:authority: localhost`.
pub(crate) struct LocalhostAuthority<S> {
    inner: S,
    state: State,
    /// Bytes read but not yet a whole preface or frame.
    pending: Vec<u8>,
    /// Bytes ready for the server.
    ready: Vec<u8>,
    ready_from: usize,
    eof: bool,
}

impl<S> LocalhostAuthority<S> {
    pub(crate) fn new(inner: S) -> Self {
        Self {
            inner,
            state: State::Preface,
            pending: Vec::new(),
            ready: Vec::new(),
            ready_from: 0,
            eof: false,
        }
    }

    /// The connection as it comes, rewriting nothing.
    pub(crate) fn unchanged(inner: S) -> Self {
        Self {
            state: State::Passthrough,
            ..Self::new(inner)
        }
    }

    /// Moves every whole unit of `pending` to `ready`, rewritten.
    fn process(&mut self) {
        loop {
            match self.state {
                State::Preface => {
                    if self.pending.len() < PREFACE.len() {
                        if !PREFACE.starts_with(&self.pending) {
                            self.state = State::Passthrough;
                            continue;
                        }
                        return;
                    }
                    self.state = if self.pending.starts_with(PREFACE) {
                        State::Frames
                    } else {
                        State::Passthrough
                    };
                    self.ready
                        .extend(self.pending.drain(..PREFACE.len().min(self.pending.len())));
                }
                State::Frames => {
                    if self.pending.len() < FRAME_HEADER {
                        return;
                    }
                    let length = (usize::from(self.pending[0]) << 16)
                        | (usize::from(self.pending[1]) << 8)
                        | usize::from(self.pending[2]);
                    if length > MAX_FRAME {
                        self.state = State::Passthrough;
                        continue;
                    }
                    if self.pending.len() < FRAME_HEADER + length {
                        return;
                    }
                    let frame: Vec<u8> = self.pending.drain(..FRAME_HEADER + length).collect();
                    match rewrite_headers_frame(&frame) {
                        Some(rewritten) => self.ready.extend(rewritten),
                        None => self.ready.extend(frame),
                    }
                }
                State::Passthrough => {
                    self.ready.append(&mut self.pending);
                    return;
                }
            }
        }
    }
}

/// A HEADERS frame whose block is whole, with the `:authority` rewritten;
/// `None` for any other frame or one that needs no change.
fn rewrite_headers_frame(frame: &[u8]) -> Option<Vec<u8>> {
    let (kind, flags) = (frame[3], frame[4]);
    if kind != HEADERS || flags & END_HEADERS == 0 {
        return None;
    }
    let payload = &frame[FRAME_HEADER..];
    let pad = if flags & PADDED != 0 {
        usize::from(*payload.first()?)
    } else {
        0
    };
    let mut start = usize::from(flags & PADDED != 0);
    if flags & PRIORITY != 0 {
        start += 5;
    }
    let end = payload.len().checked_sub(pad)?;
    let block = payload.get(start..end)?;
    let rewritten = rewrite_block(block)?;
    let mut out = Vec::with_capacity(frame.len());
    let length = payload.len() - block.len() + rewritten.len();
    out.extend_from_slice(&[(length >> 16) as u8, (length >> 8) as u8, length as u8]);
    out.extend_from_slice(&frame[3..FRAME_HEADER]);
    out.extend_from_slice(&payload[..start]);
    out.extend_from_slice(&rewritten);
    out.extend_from_slice(&payload[end..]);
    Some(out)
}

/// The header block with every literal `:authority` (name by static index)
/// valued `localhost`; `None` when there is none or the block is malformed.
fn rewrite_block(block: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(block.len());
    let mut changed = false;
    let mut at = 0;
    while at < block.len() {
        let first = block[at];
        let prefix_bits = if first & 0x80 != 0 {
            // Indexed field: nothing but the index.
            let (_, next) = integer(block, at, 7)?;
            out.extend_from_slice(&block[at..next]);
            at = next;
            continue;
        } else if first & 0xc0 == 0x40 {
            6
        } else if first & 0xe0 == 0x20 {
            // Dynamic table size update.
            let (_, next) = integer(block, at, 5)?;
            out.extend_from_slice(&block[at..next]);
            at = next;
            continue;
        } else {
            4
        };
        let (name_index, after_name) = integer(block, at, prefix_bits)?;
        let value_at = if name_index == 0 {
            string_end(block, after_name)?
        } else {
            after_name
        };
        let value_end = string_end(block, value_at)?;
        out.extend_from_slice(&block[at..value_at]);
        if name_index == AUTHORITY_INDEX {
            // Length 9 fits the 7-bit prefix; H bit clear: no Huffman.
            out.push(LOCALHOST.len() as u8);
            out.extend_from_slice(LOCALHOST);
            changed = true;
        } else {
            out.extend_from_slice(&block[value_at..value_end]);
        }
        at = value_end;
    }
    changed.then_some(out)
}

/// An HPACK integer with an `n`-bit prefix starting at `at`: its value and
/// where the next byte is.
fn integer(block: &[u8], at: usize, n: u8) -> Option<(u64, usize)> {
    let max = (1u64 << n) - 1;
    let mut value = u64::from(*block.get(at)?) & max;
    let mut next = at + 1;
    if value < max {
        return Some((value, next));
    }
    let mut shift = 0u32;
    loop {
        let byte = *block.get(next)?;
        next += 1;
        value = value.checked_add(u64::from(byte & 0x7f).checked_shl(shift)?)?;
        if byte & 0x80 == 0 {
            return Some((value, next));
        }
        shift += 7;
        if shift > 56 {
            return None;
        }
    }
}

/// Where the string literal starting at `at` ends.
fn string_end(block: &[u8], at: usize) -> Option<usize> {
    let (length, start) = integer(block, at, 7)?;
    let end = start.checked_add(usize::try_from(length).ok()?)?;
    (end <= block.len()).then_some(end)
}

impl<S: AsyncRead + Unpin> AsyncRead for LocalhostAuthority<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.ready_from < this.ready.len() {
                let n = buf.remaining().min(this.ready.len() - this.ready_from);
                buf.put_slice(&this.ready[this.ready_from..this.ready_from + n]);
                this.ready_from += n;
                if this.ready_from == this.ready.len() {
                    this.ready.clear();
                    this.ready_from = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // Whatever never made a whole frame goes as it came.
                if this.pending.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                this.ready.append(&mut this.pending);
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut read = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.inner).poll_read(cx, &mut read) {
                Poll::Ready(Ok(())) => {
                    if read.filled().is_empty() {
                        this.eof = true;
                    } else {
                        this.pending.extend_from_slice(read.filled());
                        this.process();
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<S: tonic::transport::server::Connected> tonic::transport::server::Connected
    for LocalhostAuthority<S>
{
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for LocalhostAuthority<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A literal with incremental indexing, name = static index `name`,
    /// plain value.
    fn literal(name: u8, value: &[u8]) -> Vec<u8> {
        let mut out = vec![0x40 | name, u8::try_from(value.len()).unwrap()];
        out.extend_from_slice(value);
        out
    }

    fn headers_frame(block: &[u8], flags: u8) -> Vec<u8> {
        let len = block.len();
        let mut out = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            HEADERS,
            flags,
            0,
            0,
            0,
            1,
        ];
        out.extend_from_slice(block);
        out
    }

    const PATH: &[u8] = b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.tessera.dev-reg.sock";

    #[test]
    fn the_authority_literal_becomes_localhost_and_nothing_else_moves() {
        // :method POST (indexed 3), :authority <path>, :path /x (literal, name 4),
        // never-indexed literal with a literal name, indexed dynamic entry 62.
        let mut block = vec![0x83];
        block.extend(literal(1, PATH));
        block.extend(literal(4, b"/x"));
        block.extend([0x10, 3, b'a', b'b', b'c', 1, b'v']);
        block.push(0x80 | 62);
        let out = rewrite_block(&block).unwrap();
        let mut expected = vec![0x83];
        expected.extend(literal(1, b"localhost"));
        expected.extend(literal(4, b"/x"));
        expected.extend([0x10, 3, b'a', b'b', b'c', 1, b'v']);
        expected.push(0x80 | 62);
        assert_eq!(out, expected);
        // Without an authority literal: unchanged.
        assert_eq!(rewrite_block(&[0x83, 0x80 | 62]), None);
    }

    #[test]
    fn frames_keep_their_padding_priority_and_new_length() {
        let block = literal(1, PATH);
        let mut payload = vec![2]; // pad length
        payload.extend([0, 0, 0, 0, 16]); // priority
        payload.extend(&block);
        payload.extend([0, 0]);
        let frame = headers_frame(&payload, END_HEADERS | PADDED | PRIORITY);
        let out = rewrite_headers_frame(&frame).unwrap();
        let length = (usize::from(out[0]) << 16) | (usize::from(out[1]) << 8) | usize::from(out[2]);
        assert_eq!(length, out.len() - FRAME_HEADER);
        assert_eq!(&out[3..9], &frame[3..9]);
        let body = &out[FRAME_HEADER..];
        assert_eq!(&body[..6], &payload[..6]);
        assert_eq!(
            &body[6..body.len() - 2],
            literal(1, b"localhost").as_slice()
        );
        assert_eq!(&body[body.len() - 2..], &[0, 0]);
        // A block continued in CONTINUATION frames is left alone.
        assert_eq!(rewrite_headers_frame(&headers_frame(&block, 0)), None);
    }

    #[test]
    fn malformed_blocks_are_left_alone() {
        for block in [
            vec![0x41],
            vec![0x41, 20, b'a'],
            vec![
                0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
            ],
        ] {
            assert_eq!(rewrite_block(&block), None, "{block:?}");
        }
    }

    #[tokio::test]
    async fn a_stream_is_rewritten_frame_by_frame_across_reads() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64);
        let mut sent = PREFACE.to_vec();
        sent.extend(headers_frame(&literal(1, PATH), END_HEADERS));
        let data = [0, 0, 3, 0, 1, 0, 0, 0, 1, b'a', b'b', b'c'];
        sent.extend(data);
        let writer = tokio::spawn(async move {
            // Byte by byte: frames arrive in pieces.
            for byte in sent {
                client.write_all(&[byte]).await.unwrap();
            }
        });
        let mut fixed = LocalhostAuthority::new(server);
        let mut got = Vec::new();
        fixed.read_to_end(&mut got).await.unwrap();
        writer.await.unwrap();
        let mut expected = PREFACE.to_vec();
        expected.extend(headers_frame(&literal(1, b"localhost"), END_HEADERS));
        expected.extend(data);
        assert_eq!(got, expected);
    }

    #[tokio::test]
    async fn what_is_not_http2_passes_through() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (mut client, server) = tokio::io::duplex(64);
        client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        drop(client);
        let mut got = Vec::new();
        LocalhostAuthority::new(server)
            .read_to_end(&mut got)
            .await
            .unwrap();
        assert_eq!(got, b"GET / HTTP/1.1\r\n\r\n");
    }
}
