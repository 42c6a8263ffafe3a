//! Change notifications of the stores that announce changes (Redis pub/sub, PostgreSQL
//! `LISTEN/NOTIFY`), as [`super::PolicySource::changed`] waits for them.
//!
//! A channel anyone who can reach the store can publish on is flooded cheaply (a client
//! pipelining `PUBLISH` sends millions a second; receiving each costs the gateway about a third
//! of a microsecond). Past [`FLOOD_LIMIT`] notifications within [`FLOOD_WINDOW`], the backend
//! drops its subscription and the follower polls (once a second) for [`FLOOD_QUIET`] before
//! subscribing again: a flood then costs a burst of [`FLOOD_LIMIT`] messages every
//! [`FLOOD_QUIET`], and a publication meanwhile is served within a poll.

use std::time::{Duration, Instant};

/// Notifications within [`FLOOD_WINDOW`] above which the channel counts as flooded: far above
/// any fleet's publications (each is one notification).
pub(super) const FLOOD_LIMIT: u32 = 200;
pub(super) const FLOOD_WINDOW: Duration = Duration::from_millis(100);
/// How long a flooded channel stays unsubscribed (the store is polled meanwhile).
pub(super) const FLOOD_QUIET: Duration = Duration::from_secs(10);

/// Why the change-notification channel could not be opened (the caller then polls).
#[derive(Debug, thiserror::Error)]
pub(super) enum ListenError {
    /// A cluster with no node to subscribe on.
    #[error("no node")]
    NoNode,
    #[error("timed out")]
    TimedOut,
    /// The store's own words, with any credential masked.
    #[error("{0}")]
    Store(String),
}

/// A backend's change notifications as seen by [`PolicySource::changed`]: how many arrived
/// and whether the channel is up. A notification that arrives between two calls is not lost:
/// the next call returns `true` at once.
pub(super) struct Feed {
    state: tokio::sync::watch::Sender<FeedState>,
    /// The count the last `changed()` returned on.
    seen: parking_lot::Mutex<u64>,
    /// One reconnect at a time.
    pub(super) connecting: tokio::sync::Mutex<()>,
    /// The start of the current counting window and the notifications in it.
    window: parking_lot::Mutex<(Instant, u32)>,
    /// Until when a flooded channel stays unsubscribed.
    quiet_until: parking_lot::Mutex<Option<Instant>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct FeedState {
    count: u64,
    up: bool,
}

impl Feed {
    pub(super) fn new() -> Feed {
        Feed {
            state: tokio::sync::watch::Sender::new(FeedState::default()),
            seen: parking_lot::Mutex::new(0),
            connecting: tokio::sync::Mutex::new(()),
            window: parking_lot::Mutex::new((Instant::now(), 0)),
            quiet_until: parking_lot::Mutex::new(None),
        }
    }

    /// Whether a flood keeps the channel unsubscribed now (the caller polls instead).
    pub(super) fn quiet(&self) -> bool {
        self.quiet_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
    }

    pub(super) fn is_up(&self) -> bool {
        self.state.borrow().up
    }

    /// Counts a notification. Returns `false` when the channel is flooded: the caller drops
    /// its subscription (and marks the feed down); [`Feed::quiet`] holds for [`FLOOD_QUIET`].
    pub(super) fn notified(&self) -> bool {
        self.state.send_modify(|s| s.count += 1);
        let now = Instant::now();
        let mut window = self.window.lock();
        if now.duration_since(window.0) >= FLOOD_WINDOW {
            *window = (now, 0);
        }
        window.1 += 1;
        if window.1 <= FLOOD_LIMIT {
            return true;
        }
        *window = (now, 0);
        *self.quiet_until.lock() = Some(now + FLOOD_QUIET);
        tracing::warn!(
            "more than {FLOOD_LIMIT} change notifications within {} ms: not listening for {} s (the store is polled meanwhile)",
            FLOOD_WINDOW.as_millis(),
            FLOOD_QUIET.as_secs()
        );
        false
    }

    pub(super) fn set_up(&self, up: bool) {
        self.state.send_modify(|s| s.up = up);
    }

    /// `true` once a notification arrives (or has arrived since the last call); `false` at
    /// `at_most` or when the channel goes down.
    pub(super) async fn wait(&self, at_most: Duration) -> bool {
        let mut rx = self.state.subscribe();
        let deadline = tokio::time::Instant::now() + at_most;
        loop {
            let now = *rx.borrow_and_update();
            {
                let mut seen = self.seen.lock();
                if now.count > *seen {
                    *seen = now.count;
                    return true;
                }
            }
            if !now.up {
                return false;
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }
}
