//! Deadlines on a client's progress that run only while the proxy waits on
//! it: a body that stops arriving ([`super::upstream::ClientBody`]) and a
//! connection that stops reading what it is sent ([`SendTimeout`]).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

/// A deadline armed when a poll is pending (and not already armed) and
/// disarmed when one is ready, so that it bounds each wait, not the sum of
/// them. The timer is made at the first wait and reset after.
pub struct Stall {
    limit: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    waiting: bool,
}

impl Stall {
    /// A deadline of `limit` on each wait; `None` for none.
    pub fn new(limit: Option<Duration>) -> Stall {
        Stall {
            limit,
            timer: None,
            waiting: false,
        }
    }

    /// `polled`, or `Ready(None)` once it has been pending for the whole
    /// limit.
    pub fn watch<T>(&mut self, polled: Poll<T>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        if let Poll::Ready(value) = polled {
            self.waiting = false;
            return Poll::Ready(Some(value));
        }
        let Some(limit) = self.limit else {
            return Poll::Pending;
        };
        if !self.waiting {
            self.waiting = true;
            let at = Instant::now() + limit;
            match &mut self.timer {
                Some(timer) => timer.as_mut().reset(at),
                None => self.timer = Some(Box::pin(tokio::time::sleep_until(at))),
            }
        }
        match self.timer.as_mut().map(|timer| timer.as_mut().poll(cx)) {
            Some(Poll::Ready(())) => Poll::Ready(None),
            _ => Poll::Pending,
        }
    }
}

/// A client connection whose writes fail once the client has taken
/// nothing for `client_send_timeout_ms` (its socket's buffers full): a
/// client that stops reading its answer does not hold the connection, nor
/// the upstream's answer behind it, for longer. Reads pass through (the
/// header and body timeouts bound them).
pub struct SendTimeout<S> {
    io: S,
    stall: Stall,
}

impl<S> SendTimeout<S> {
    pub fn new(io: S, limit: Option<Duration>) -> SendTimeout<S> {
        SendTimeout {
            io,
            stall: Stall::new(limit),
        }
    }
}

/// The error of a write the client did not take in time.
fn timed_out<T>(watched: Poll<Option<io::Result<T>>>) -> Poll<io::Result<T>> {
    watched.map(|written| {
        written.unwrap_or_else(|| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read its answer in time",
            ))
        })
    })
}

impl<S: AsyncRead + Unpin> AsyncRead for SendTimeout<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for SendTimeout<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, buf);
        timed_out(this.stall.watch(polled, cx))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        timed_out(this.stall.watch(polled, cx))
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_flush(cx);
        timed_out(this.stall.watch(polled, cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_shutdown(cx);
        timed_out(this.stall.watch(polled, cx))
    }
}
