//! A person's write from the CLI (a decision, a result) while the cluster
//! is away for a moment (its API server or etcd restarting): tried again
//! with backoff, a bounded number of times, and only when the store said
//! "try later" (a connection error, a timeout, 429 or 5xx). A refusal (any
//! other 4xx) is not tried again, except a 403 that follows the cluster's
//! absence within the same command: an API server just started refuses
//! everyone until it has loaded who may do what. Trying again is safe: the
//! writes are write-once, and the same decision or result written twice is
//! a harmless repeat.

use super::out;
use crate::store::StoreError;
use std::future::Future;
use std::time::{Duration, Instant};

/// Tries of one command before it gives up.
pub const TRIES: u32 = 10;
const FIRST_PAUSE: Duration = Duration::from_millis(500);
const LONGEST_PAUSE: Duration = Duration::from_secs(8);

/// `attempt` until it succeeds, fails for a reason of its own, or the
/// cluster stayed away for [`TRIES`] tries (about 45 s); `what` names the
/// write in what the person reads.
pub async fn patiently<T, F, Fut>(what: &str, attempt: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    retry(what, FIRST_PAUSE, attempt).await
}

/// [`patiently`], its first pause `first` (doubling up to [`LONGEST_PAUSE`]).
async fn retry<T, F, Fut>(what: &str, first: Duration, mut attempt: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<T>>,
{
    let started = Instant::now();
    let mut pause = first;
    let mut tries = 1;
    let mut was_away = false;
    loop {
        let error = match attempt().await {
            Err(e) if is_away(&e) || (was_away && is_forbidden(&e)) => e,
            other => return other,
        };
        was_away = true;
        if tries >= TRIES {
            return Err(error.context(format!(
                "{what} may not be recorded: the cluster did not answer in {TRIES} tries over {} s. \
                 Run the same command again once it answers (kubectl get --raw /readyz); \
                 a repeat of the same {what} is harmless",
                started.elapsed().as_secs()
            )));
        }
        let why = if is_away(&error) {
            "the cluster did not answer"
        } else {
            "the API server refused it just after coming back, as one does until it has loaded who may do what"
        };
        out::err_line(&format!(
            "{what}: {why} ({error}); trying again in {:.1} s ({tries} of {TRIES})",
            pause.as_secs_f64()
        ));
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(LONGEST_PAUSE);
        tries += 1;
    }
}

/// The API server refused the request as forbidden (RBAC): final, unless
/// it has just come back (see the module's note).
fn is_forbidden(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(c.downcast_ref::<StoreError>(),
            Some(StoreError::Backend(why)) if why.starts_with("the API server answered 403"))
    })
}

/// The store is away or throttling for now: the same request may pass soon.
fn is_away(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<StoreError>()
            .is_some_and(StoreError::is_transient)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[tokio::test]
    async fn an_absent_store_is_tried_again_and_a_refusal_is_not() {
        let calls = AtomicU32::new(0);
        let back = retry("the decision", Duration::from_millis(1), || async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 | 1 => Err(StoreError::Unavailable("connection refused".into()).into()),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!(back.unwrap(), 7);
        assert_eq!(calls.load(Ordering::SeqCst), 3);

        let calls = AtomicU32::new(0);
        let refused: anyhow::Result<()> =
            retry("the decision", Duration::from_millis(1), || async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err(StoreError::Backend("the API server answered 403 Forbidden".into()).into())
            })
            .await;
        assert!(refused.is_err());
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "a 4xx is never tried again"
        );

        // A restarted API server refuses until it has loaded its RBAC: a 403
        // right after the cluster was away is tried again.
        let calls = AtomicU32::new(0);
        let back = retry("the decision", Duration::from_millis(1), || async {
            match calls.fetch_add(1, Ordering::SeqCst) {
                0 => Err(StoreError::Unavailable("connection refused".into()).into()),
                1 => Err(StoreError::Backend(
                    "the API server answered 403 Forbidden: cannot get".into(),
                )
                .into()),
                _ => Ok(8),
            }
        })
        .await;
        assert_eq!(back.unwrap(), 8);
        assert_eq!(calls.load(Ordering::SeqCst), 3);

        let calls = AtomicU32::new(0);
        let away: anyhow::Result<()> = retry("the decision", Duration::from_millis(1), || async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err(StoreError::Unavailable("connection refused".into()).into())
        })
        .await;
        let said = format!("{:#}", away.unwrap_err());
        assert_eq!(calls.load(Ordering::SeqCst), TRIES);
        assert!(
            said.contains("may not be recorded") && said.contains("connection refused"),
            "{said}"
        );
    }
}
