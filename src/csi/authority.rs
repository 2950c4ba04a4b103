//! Accepts any HTTP/2 `:authority` on the unix CSI socket.
//!
//! gRPC clients derive the `:authority` of a `unix://` target from the socket path; grpc-core
//! (Python `grpcio`, Ruby, C++) sends e.g. `tmp%2Fcsi%2Fcsi.sock`. h2 parses `:authority` into
//! a URI authority and resets every stream whose value does not parse (RST_STREAM
//! PROTOCOL_ERROR), with no option to relax it. On a unix socket the authority means nothing,
//! so [`AnyAuthority`] sits between the socket and the server and rewrites what the client
//! sends: it decodes every request header block (HEADERS plus CONTINUATION frames) with the
//! client's HPACK state, replaces an `:authority` that is not a valid URI authority by
//! `localhost`, and encodes the block again with its own HPACK state towards the server. Every
//! other byte passes through unchanged; responses are not touched.

use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_CONTINUATION: u8 = 0x9;
const FLAG_END_STREAM: u8 = 0x1;
const FLAG_END_HEADERS: u8 = 0x4;
const FLAG_PADDED: u8 = 0x8;
const FLAG_PRIORITY: u8 = 0x20;
/// Every HTTP/2 peer accepts frames this large (SETTINGS_MAX_FRAME_SIZE is at least this).
const MAX_FRAME: usize = 16_384;
/// Largest header block accepted; CSI requests carry a few hundred bytes of headers.
const MAX_BLOCK: usize = 1 << 20;
/// HPACK dynamic table size: the default, which the server (h2) never changes.
const TABLE_SIZE: usize = 4096;
/// What an invalid `:authority` becomes.
const REPLACEMENT: &[u8] = b"localhost";

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

/// A HEADERS frame waiting for its CONTINUATION frames.
struct Pending {
    stream_id: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
}

enum State {
    /// Checking the client preface; `usize` bytes of it seen.
    Preface(usize),
    Frames,
    /// Not HTTP/2 with prior knowledge: leave everything to the server.
    Passthrough,
}

/// The client-to-server byte rewriter (no I/O, so it is testable on its own).
struct Rewriter {
    state: State,
    input: BytesMut,
    /// Payload bytes of the current non-header frame still to copy as they are.
    copy_left: usize,
    pending: Option<Pending>,
    decoder: loona_hpack::Decoder<'static>,
    encoder: loona_hpack::Encoder<'static>,
    rewritten: u64,
}

impl Rewriter {
    fn new() -> Self {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        Rewriter {
            state: State::Preface(0),
            input: BytesMut::new(),
            copy_left: 0,
            pending: None,
            decoder,
            encoder: loona_hpack::Encoder::new(),
            rewritten: 0,
        }
    }

    /// Takes bytes read from the client; appends what the server should read to `out`.
    fn feed(&mut self, data: &[u8], out: &mut BytesMut) -> io::Result<()> {
        self.input.extend_from_slice(data);
        loop {
            match self.state {
                State::Passthrough => {
                    out.extend_from_slice(&self.input.split());
                    return Ok(());
                }
                State::Preface(seen) => {
                    let want = PREFACE.len() - seen;
                    let n = want.min(self.input.len());
                    if self.input[..n] != PREFACE[seen..seen + n] {
                        self.state = State::Passthrough;
                        continue;
                    }
                    out.extend_from_slice(&self.input.split_to(n));
                    if n < want {
                        self.state = State::Preface(seen + n);
                        return Ok(());
                    }
                    self.state = State::Frames;
                }
                State::Frames => {
                    if self.copy_left > 0 {
                        let n = self.copy_left.min(self.input.len());
                        if n == 0 {
                            return Ok(());
                        }
                        out.extend_from_slice(&self.input.split_to(n));
                        self.copy_left -= n;
                        continue;
                    }
                    if self.input.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let h = &self.input[..FRAME_HEADER];
                    let len =
                        (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                    let (kind, flags) = (h[3], h[4]);
                    let stream_id = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    if kind != TYPE_HEADERS && kind != TYPE_CONTINUATION {
                        if self.pending.is_some() {
                            return Err(invalid("HTTP/2: a header block was interrupted"));
                        }
                        out.extend_from_slice(&self.input.split_to(FRAME_HEADER));
                        self.copy_left = len;
                        continue;
                    }
                    if len > MAX_BLOCK {
                        return Err(invalid("HTTP/2: header frame too large"));
                    }
                    if self.input.len() < FRAME_HEADER + len {
                        return Ok(());
                    }
                    self.input.advance(FRAME_HEADER);
                    let payload = self.input.split_to(len);
                    self.header_frame(kind, flags, stream_id, &payload, out)?;
                }
            }
        }
    }

    fn header_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream_id: u32,
        payload: &[u8],
        out: &mut BytesMut,
    ) -> io::Result<()> {
        if kind == TYPE_HEADERS {
            if self.pending.is_some() {
                return Err(invalid("HTTP/2: a header block was interrupted"));
            }
            let mut start = 0;
            let mut pad = 0;
            if flags & FLAG_PADDED != 0 {
                pad = usize::from(
                    *payload
                        .first()
                        .ok_or_else(|| invalid("HTTP/2: bad padding"))?,
                );
                start = 1;
            }
            let mut priority = None;
            if flags & FLAG_PRIORITY != 0 {
                let p: [u8; 5] = payload
                    .get(start..start + 5)
                    .and_then(|s| s.try_into().ok())
                    .ok_or_else(|| invalid("HTTP/2: bad priority"))?;
                priority = Some(p);
                start += 5;
            }
            let end = payload
                .len()
                .checked_sub(pad)
                .filter(|e| *e >= start)
                .ok_or_else(|| invalid("HTTP/2: bad padding"))?;
            self.pending = Some(Pending {
                stream_id,
                flags,
                priority,
                block: payload[start..end].to_vec(),
            });
        } else {
            let p = self
                .pending
                .as_mut()
                .filter(|p| p.stream_id == stream_id)
                .ok_or_else(|| invalid("HTTP/2: unexpected CONTINUATION"))?;
            if p.block.len() + payload.len() > MAX_BLOCK {
                return Err(invalid("HTTP/2: header block too large"));
            }
            p.block.extend_from_slice(payload);
        }
        if flags & FLAG_END_HEADERS != 0 {
            if let Some(p) = self.pending.take() {
                self.finish(p, out)?;
            }
        }
        Ok(())
    }

    /// Decodes a complete header block, fixes `:authority`, and emits it re-encoded.
    fn finish(&mut self, p: Pending, out: &mut BytesMut) -> io::Result<()> {
        let mut headers = self
            .decoder
            .decode(&p.block)
            .map_err(|e| invalid(format!("HTTP/2: bad header block: {e:?}")))?;
        for (name, value) in headers.iter_mut() {
            if name.as_slice() == b":authority"
                && tonic::codegen::http::uri::Authority::try_from(value.as_slice()).is_err()
            {
                *value = REPLACEMENT.to_vec();
                self.rewritten += 1;
            }
        }
        let block = self
            .encoder
            .encode(headers.iter().map(|(n, v)| (n.as_slice(), v.as_slice())));
        let mut first = true;
        let mut rest: &[u8] = &block;
        loop {
            let prio = if first { p.priority } else { None };
            let room = MAX_FRAME - prio.map_or(0, |_| 5);
            let (chunk, tail) = rest.split_at(rest.len().min(room));
            let last = tail.is_empty();
            let (kind, mut flags) = if first {
                (TYPE_HEADERS, p.flags & (FLAG_END_STREAM | FLAG_PRIORITY))
            } else {
                (TYPE_CONTINUATION, 0)
            };
            if last {
                flags |= FLAG_END_HEADERS;
            }
            let len = chunk.len() + prio.map_or(0, |_| 5);
            out.extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
            out.extend_from_slice(&p.stream_id.to_be_bytes());
            if let Some(pr) = prio {
                out.extend_from_slice(&pr);
            }
            out.extend_from_slice(chunk);
            if last {
                return Ok(());
            }
            first = false;
            rest = tail;
        }
    }
}

/// A server-side connection whose client's invalid `:authority` values are replaced (see the
/// module comment). Writes go straight to the inner stream.
pub struct AnyAuthority<T> {
    inner: T,
    rewriter: Rewriter,
    out: BytesMut,
    eof: bool,
}

impl<T> AnyAuthority<T> {
    pub fn new(inner: T) -> Self {
        AnyAuthority {
            inner,
            rewriter: Rewriter::new(),
            out: BytesMut::new(),
            eof: false,
        }
    }
}

impl<T> Drop for AnyAuthority<T> {
    fn drop(&mut self) {
        if self.rewriter.rewritten > 0 {
            tracing::debug!(
                requests = self.rewriter.rewritten,
                "replaced a client's invalid :authority (unix socket)"
            );
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for AnyAuthority<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.out.is_empty() {
                let n = buf.remaining().min(this.out.len());
                buf.put_slice(&this.out.split_to(n));
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 16 * 1024];
            let mut rb = ReadBuf::new(&mut tmp);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                this.eof = true;
                continue;
            }
            this.rewriter.feed(rb.filled(), &mut this.out)?;
        }
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for AnyAuthority<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl<T: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AnyAuthority<T>
{
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len();
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// Parses frames back: (kind, flags, stream, payload).
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    fn request(enc: &mut loona_hpack::Encoder<'static>, authority: &[u8]) -> Vec<u8> {
        enc.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/csi.v1.Identity/GetPluginInfo"),
            (b":authority", authority),
            (b"content-type", b"application/grpc"),
        ])
    }

    #[test]
    fn invalid_authority_is_replaced_and_the_rest_kept() {
        let mut client = loona_hpack::Encoder::new();
        let mut server = loona_hpack::Decoder::new();
        let mut rw = Rewriter::new();
        let mut out = BytesMut::new();
        let bad = b"tmp%2Fcsi%2Fcsi.sock";
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[])); // SETTINGS
                                             // Split over a HEADERS and a CONTINUATION frame, padded, with priority.
        let block = request(&mut client, bad);
        let (a, b) = block.split_at(block.len() / 2);
        let mut p = vec![2u8, 0, 0, 0, 0, 16];
        p.extend_from_slice(a);
        p.extend_from_slice(&[0, 0]);
        input.extend(frame(TYPE_HEADERS, FLAG_PADDED | FLAG_PRIORITY, 1, &p));
        input.extend(frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, b));
        input.extend(frame(0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\0"));
        // The second request reuses the client's dynamic table entries.
        let block2 = request(&mut client, bad);
        input.extend(frame(TYPE_HEADERS, FLAG_END_HEADERS, 3, &block2));
        let block3 = request(&mut client, b"localhost:1234");
        input.extend(frame(
            TYPE_HEADERS,
            FLAG_END_HEADERS | FLAG_END_STREAM,
            5,
            &block3,
        ));
        // Byte by byte: frames may arrive in any pieces.
        for b in &input {
            rw.feed(std::slice::from_ref(b), &mut out).unwrap();
        }
        assert_eq!(&out[..PREFACE.len()], PREFACE);
        let fs = frames(&out[PREFACE.len()..]);
        assert_eq!(fs.len(), 5, "{fs:?}");
        assert_eq!(fs[0].0, 0x4);
        let authority = |payload: &[u8], server: &mut loona_hpack::Decoder<'static>| {
            server
                .decode(payload)
                .unwrap()
                .into_iter()
                .find(|(n, _)| n == b":authority")
                .map(|(_, v)| v)
                .unwrap()
        };
        let (kind, flags, stream, payload) = &fs[1];
        assert_eq!(
            (*kind, *flags, *stream),
            (TYPE_HEADERS, FLAG_PRIORITY | FLAG_END_HEADERS, 1)
        );
        assert_eq!(&payload[..5], &[0, 0, 0, 0, 16]);
        assert_eq!(authority(&payload[5..], &mut server), b"localhost");
        assert_eq!(fs[2], (0x0, FLAG_END_STREAM, 1, b"\0\0\0\0\0".to_vec()));
        assert_eq!(authority(&fs[3].3, &mut server), b"localhost");
        assert_eq!(
            authority(&fs[4].3, &mut server),
            b"localhost:1234",
            "valid ones stay"
        );
        assert_eq!(fs[4].1, FLAG_END_HEADERS | FLAG_END_STREAM);
        assert_eq!(rw.rewritten, 2);
    }

    #[test]
    fn garbage_is_refused_or_passed_through_without_panicking() {
        let mut out = BytesMut::new();
        // Not HTTP/2: passed through for the server to refuse.
        let mut rw = Rewriter::new();
        rw.feed(b"GET / HTTP/1.1\r\n\r\n", &mut out).unwrap();
        assert_eq!(&out[..], b"GET / HTTP/1.1\r\n\r\n");
        // A header block that is not HPACK, bad padding, a stray CONTINUATION: errors.
        for f in [
            frame(
                TYPE_HEADERS,
                FLAG_END_HEADERS,
                1,
                &[0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
            ),
            frame(TYPE_HEADERS, FLAG_END_HEADERS | FLAG_PADDED, 1, &[9, 1]),
            frame(TYPE_CONTINUATION, FLAG_END_HEADERS, 1, &[0x82]),
        ] {
            let mut rw = Rewriter::new();
            let mut input = PREFACE.to_vec();
            input.extend(f);
            assert!(rw.feed(&input, &mut out).is_err());
        }
    }
}
