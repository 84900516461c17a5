//! A coarse timer for the deadlines a request sets and almost never reaches: hyper's
//! header-read timeout (set each time a keep-alive connection waits for its next head) and
//! the upstream first-byte timeout.
//!
//! tokio's timer wheel takes its lock to insert each timer and again to remove it, and when
//! the new deadline is earlier than the one the runtime last parked on, it also writes the
//! runtime's eventfd: a syscall, and a wake-up of `epoll_wait` with nothing to do. Measured
//! under load on keep-alive connections, hyper's header-read timer made 0.52 such writes a
//! request (`strace -c`), every eventfd write kvgate made.
//!
//! Here a timer is a slot in the slab of the thread that made it: one uncontended lock to
//! take a slot and one to free it, no syscall. One background thread (`kvgate-timer`) wakes
//! every [`TICK`] and fires each slot whose deadline has passed. A timer never fires before
//! its deadline, and at most about one tick after it.

use std::{
    future::Future,
    io,
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError, Weak},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use slab::Slab;

/// How often the timer thread looks for expired timers: the most a timer fires late, plus
/// the thread's own scheduling delay.
pub(crate) const TICK: Duration = Duration::from_millis(20);

/// The timers made on one thread.
#[derive(Debug, Default)]
struct Wheel {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    slots: Slab<Slot>,
    /// No slot's deadline is earlier (it may be later: a freed slot does not raise it).
    earliest: Option<Instant>,
}

#[derive(Debug)]
struct Slot {
    deadline: Instant,
    waker: Option<Waker>,
    fired: bool,
}

impl Wheel {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the slab consistent (every method edits one
        // slot), so a poisoned lock is used as it is.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Fires every slot whose deadline is at or before `now`.
    fn fire(&self, now: Instant) {
        let mut due = Vec::new();
        {
            let mut state = self.lock();
            if state.earliest.is_none_or(|e| e > now) {
                return;
            }
            let mut earliest = None;
            for (_, slot) in state.slots.iter_mut() {
                if slot.fired {
                    continue;
                }
                if slot.deadline <= now {
                    slot.fired = true;
                    due.extend(slot.waker.take());
                } else if earliest.is_none_or(|e| slot.deadline < e) {
                    earliest = Some(slot.deadline);
                }
            }
            state.earliest = earliest;
        }
        // Woken outside the lock: a waker may run the task (or drop a timer) at once.
        due.into_iter().for_each(Waker::wake);
    }

    /// The wheel of the calling thread, made (and given to the timer thread) on first use.
    fn current() -> Arc<Wheel> {
        thread_local! {
            static LOCAL: Arc<Wheel> = Wheel::register();
        }
        LOCAL.with(Arc::clone)
    }

    fn register() -> Arc<Wheel> {
        if let Err(e) = start() {
            tracing::error!(error = %e, "the timer thread is not running: coarse timers will not fire");
        }
        let wheel = Arc::new(Wheel::default());
        WHEELS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Arc::downgrade(&wheel));
        wheel
    }
}

/// Every thread's wheel, for the timer thread.
static WHEELS: Mutex<Vec<Weak<Wheel>>> = Mutex::new(Vec::new());

/// Starts the timer thread, once; a later call returns the first call's outcome. The
/// server calls it before it accepts, so that a failure stops it there; a timer made
/// before that starts the thread itself.
///
/// # Errors
/// The OS refused to spawn the thread.
pub(crate) fn start() -> io::Result<()> {
    static STARTED: OnceLock<Result<(), io::ErrorKind>> = OnceLock::new();
    let started = STARTED.get_or_init(|| {
        std::thread::Builder::new()
            .name("kvgate-timer".into())
            .spawn(fire_forever)
            .map(drop)
            .map_err(|e| e.kind())
    });
    started.map_err(|kind| io::Error::new(kind, "spawning the kvgate-timer thread"))
}

/// The timer thread: each [`TICK`], fires every wheel's expired timers.
fn fire_forever() {
    loop {
        std::thread::sleep(TICK);
        let now = Instant::now();
        // Upgraded under the lock, fired outside it: a thread starting meanwhile can
        // register its wheel.
        let live: Vec<Arc<Wheel>> = {
            let mut wheels = WHEELS.lock().unwrap_or_else(PoisonError::into_inner);
            wheels.retain(|w| w.strong_count() > 0);
            wheels.iter().filter_map(Weak::upgrade).collect()
        };
        live.iter().for_each(|w| w.fire(now));
    }
}

/// A future that completes at (or up to about a [`TICK`] after) its deadline. It takes a
/// slot only when first polled, and frees it when dropped.
#[derive(Debug)]
pub(crate) struct CoarseSleep {
    wheel: Arc<Wheel>,
    deadline: Instant,
    slot: Option<usize>,
}

impl CoarseSleep {
    /// A sleep until `deadline`, on the calling thread's wheel.
    pub(crate) fn until(deadline: Instant) -> CoarseSleep {
        CoarseSleep {
            wheel: Wheel::current(),
            deadline,
            slot: None,
        }
    }

    /// Moves the deadline; a sleep that had fired waits again.
    pub(crate) fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        if let Some(key) = self.slot {
            let mut state = self.wheel.lock();
            let slot = &mut state.slots[key];
            slot.deadline = deadline;
            slot.fired = false;
            if state.earliest.is_none_or(|e| deadline < e) {
                state.earliest = Some(deadline);
            }
        }
    }
}

impl Future for CoarseSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let mut state = this.wheel.lock();
        match this.slot {
            Some(key) => {
                let slot = &mut state.slots[key];
                if slot.fired {
                    return Poll::Ready(());
                }
                match &mut slot.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
            }
            None => {
                let deadline = this.deadline;
                this.slot = Some(state.slots.insert(Slot {
                    deadline,
                    waker: Some(cx.waker().clone()),
                    fired: false,
                }));
                if state.earliest.is_none_or(|e| deadline < e) {
                    state.earliest = Some(deadline);
                }
            }
        }
        Poll::Pending
    }
}

impl Drop for CoarseSleep {
    fn drop(&mut self) {
        if let Some(key) = self.slot.take() {
            self.wheel.lock().slots.remove(key);
        }
    }
}

impl hyper::rt::Sleep for CoarseSleep {}

/// hyper's [`Timer`](hyper::rt::Timer) on coarse sleeps.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CoarseTimer;

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        self.sleep_until(Instant::now() + duration)
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(CoarseSleep::until(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<CoarseSleep>() {
            Some(s) => s.get_mut().reset(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

/// The error of a [`timeout`] whose deadline passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// `fut`, or [`Elapsed`] once `duration` has passed: `tokio::time::timeout` on a coarse
/// sleep. The sleep takes its slot only if `fut` is not ready at the first poll.
pub(crate) fn timeout<F: Future>(duration: Duration, fut: F) -> Timeout<F> {
    Timeout {
        fut,
        sleep: CoarseSleep::until(Instant::now() + duration),
    }
}

pin_project_lite::pin_project! {
    /// The future of [`timeout`].
    #[derive(Debug)]
    pub(crate) struct Timeout<F> {
        #[pin]
        fut: F,
        sleep: CoarseSleep,
    }
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Poll::Ready(v) = this.fut.poll(cx) {
            return Poll::Ready(Ok(v));
        }
        Pin::new(this.sleep).poll(cx).map(|()| Err(Elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(s: &CoarseSleep) -> usize {
        s.wheel.lock().slots.len()
    }

    #[tokio::test]
    async fn a_sleep_completes_no_earlier_than_its_deadline() {
        let deadline = Instant::now() + Duration::from_millis(50);
        CoarseSleep::until(deadline).await;
        assert!(Instant::now() >= deadline);
    }

    #[tokio::test]
    async fn a_past_deadline_completes() {
        CoarseSleep::until(Instant::now()).await;
    }

    #[tokio::test]
    async fn a_slot_is_taken_at_the_first_poll_and_freed_on_drop() {
        let mut sleep = CoarseSleep::until(Instant::now() + Duration::from_secs(3600));
        let before = slots(&sleep);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut sleep).poll(&mut cx).is_pending());
        assert_eq!(slots(&sleep), before + 1);
        let wheel = sleep.wheel.clone();
        drop(sleep);
        assert_eq!(wheel.lock().slots.len(), before);
    }

    #[tokio::test]
    async fn reset_moves_a_registered_deadline_both_ways() {
        let mut sleep = CoarseSleep::until(Instant::now() + Duration::from_secs(3600));
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut sleep).poll(&mut cx).is_pending());
        // Earlier: it now fires at the next tick.
        let soon = Instant::now() + Duration::from_millis(10);
        sleep.reset(soon);
        (&mut sleep).await;
        assert!(Instant::now() >= soon);
        // Later again: a fired sleep waits for its new deadline.
        sleep.reset(Instant::now() + Duration::from_secs(3600));
        assert!(Pin::new(&mut sleep).poll(&mut cx).is_pending());
    }

    #[tokio::test]
    async fn timeout_returns_the_value_or_elapsed() {
        assert_eq!(timeout(Duration::from_secs(3600), async { 7 }).await, Ok(7));
        let never = std::future::pending::<()>();
        assert_eq!(
            timeout(Duration::from_millis(30), never).await,
            Err(Elapsed)
        );
    }

    #[tokio::test]
    async fn a_ready_future_takes_no_slot() {
        let t = timeout(Duration::from_secs(3600), async { 1 });
        let wheel = t.sleep.wheel.clone();
        let before = wheel.lock().slots.len();
        let mut t = Box::pin(t);
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        assert_eq!(t.as_mut().poll(&mut cx), Poll::Ready(Ok(1)));
        assert_eq!(wheel.lock().slots.len(), before);
    }
}
