//! Change notifications of the stores that announce changes (Redis pub/sub, PostgreSQL
//! `LISTEN/NOTIFY`), as [`super::PolicySource::changed`] waits for them.

use std::time::Duration;

/// A backend's change notifications as seen by [`PolicySource::changed`]: how many arrived
/// and whether the channel is up. A notification that arrives between two calls is not lost:
/// the next call returns `true` at once.
pub(super) struct Feed {
    state: tokio::sync::watch::Sender<FeedState>,
    /// The count the last `changed()` returned on.
    seen: parking_lot::Mutex<u64>,
    /// One reconnect at a time.
    pub(super) connecting: tokio::sync::Mutex<()>,
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
        }
    }

    pub(super) fn is_up(&self) -> bool {
        self.state.borrow().up
    }

    pub(super) fn notified(&self) {
        self.state.send_modify(|s| s.count += 1);
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
