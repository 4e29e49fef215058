//! The client side of MCP Tasks (`io.modelcontextprotocol/tasks`, the
//! 2026-07-28 extension): a `tools/call` may be answered with a task
//! handle (`resultType: "task"`), which is polled with `tasks/get`,
//! answered with `tasks/update` while it asks for input, and stopped with
//! `tasks/cancel`. The client declares the extension on every request of
//! the stateless revision; servers of the session-based revisions never
//! make tasks unasked.

use super::{interpret_call, Connection, McpError, McpPool, Resolved};
use crate::core::call::TaskHandle;
use crate::core::ToolResult;
use crate::ports::{TaskPoll, ToolRun};
use serde_json::{json, Map, Value};

/// The extension's identifier, as declared in the client's capabilities.
pub const TASKS_EXTENSION: &str = "io.modelcontextprotocol/tasks";
/// The poll interval assumed when a server names none.
pub const DEFAULT_POLL_MS: u64 = 2_000;
/// The longest task id taken (a handle is stored in the session).
pub const MAX_TASK_ID_BYTES: usize = 256;
/// The most a request for input may hold (it is stored in the session
/// for a person to read).
pub const MAX_ASKS_BYTES: usize = 16 * 1024;
/// Polls in a row that may fail to reach the server before the task is
/// given up (counted per process; a restart counts again).
pub const MAX_UNREACHABLE_POLLS: u32 = 30;
/// How long one tasks/ request may take.
pub const TASK_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// `method` on the task, within [`TASK_REQUEST_TIMEOUT`].
async fn task_request(
    conn: &Connection,
    method: &str,
    params: Map<String, Value>,
) -> Result<Value, McpError> {
    tokio::time::timeout(TASK_REQUEST_TIMEOUT, conn.request(method, params))
        .await
        .unwrap_or_else(|_| {
            Err(McpError::Transport(format!(
                "{method} took longer than {}s",
                TASK_REQUEST_TIMEOUT.as_secs()
            )))
        })
}

/// What a `tools/call` result is: the tool's result, or a task to poll.
pub fn answer_of(result: &Value) -> ToolRun {
    if result.get("resultType").and_then(Value::as_str) != Some("task") {
        return ToolRun::Done(interpret_call(result));
    }
    match handle_of(result) {
        Ok(handle) => ToolRun::Task(handle),
        Err(why) => ToolRun::Done(ToolResult::error(format!(
            "the MCP server answered with a task this client cannot follow: {why}"
        ))),
    }
}

fn handle_of(task: &Value) -> Result<TaskHandle, String> {
    let id = task
        .get("taskId")
        .and_then(Value::as_str)
        .ok_or("it has no taskId")?;
    if id.is_empty() || id.len() > MAX_TASK_ID_BYTES || id.chars().any(char::is_control) {
        return Err(format!(
            "its taskId is empty, longer than {MAX_TASK_ID_BYTES} bytes, or holds control characters"
        ));
    }
    let poll_ms = task
        .get("pollIntervalMs")
        .and_then(Value::as_u64)
        .unwrap_or(DEFAULT_POLL_MS);
    Ok(TaskHandle {
        id: id.to_string(),
        poll_ms,
    })
}

/// What a `tasks/get` result says.
pub fn poll_of(task: &Value) -> TaskPoll {
    let message = task
        .get("statusMessage")
        .and_then(Value::as_str)
        .map(|m| format!(": {}", crate::http::clip(m, 2000)))
        .unwrap_or_default();
    match task.get("status").and_then(Value::as_str) {
        Some("working") => TaskPoll::Working,
        Some("input_required") => asks_of(task),
        Some("completed") => match task.get("result") {
            Some(result) => TaskPoll::Ended(interpret_call(result)),
            None => TaskPoll::Ended(ToolResult::error(
                "the MCP task completed without a result",
            )),
        },
        Some("failed") => {
            let error = task.get("error").cloned().unwrap_or_default();
            let why = error
                .get("message")
                .and_then(Value::as_str)
                .map(|m| crate::http::clip(m, 2000).to_string())
                .unwrap_or_else(|| "no reason given".into());
            TaskPoll::Ended(ToolResult::error(format!("the MCP task failed: {why}")))
        }
        Some("cancelled") => TaskPoll::Ended(ToolResult::error(format!(
            "the MCP server cancelled the task{message}"
        ))),
        other => TaskPoll::Ended(ToolResult::error(format!(
            "the MCP server reported the task in status {other:?}, which the tasks extension does not define"
        ))),
    }
}

fn asks_of(task: &Value) -> TaskPoll {
    let asks = task.get("inputRequests").cloned().unwrap_or(json!({}));
    let text = asks.to_string();
    if !asks.is_object() {
        return TaskPoll::Ended(ToolResult::error(
            "the MCP task asks for input, but its inputRequests is not an object",
        ));
    }
    if text.len() > MAX_ASKS_BYTES {
        return TaskPoll::Ended(ToolResult::error(format!(
            "the MCP task asks for input in {} bytes; at most {MAX_ASKS_BYTES} are taken",
            text.len()
        )));
    }
    TaskPoll::AsksForInput(text)
}

/// The tasks a process follows at most (a bound: the oldest knowledge is
/// dropped at once, which costs at most an early poll).
const MAX_FOLLOWED_TASKS: usize = 4096;

/// A task's polls in this process.
#[derive(Debug, Default)]
pub(crate) struct Polls {
    /// When it was last polled.
    last: Option<std::time::Instant>,
    /// Polls in a row that failed to reach its server.
    misses: u32,
}

impl McpPool {
    /// `tasks/update` with `answers` (an `inputResponses` object), then
    /// `tasks/get`. An unreachable server counts towards
    /// [`MAX_UNREACHABLE_POLLS`]; a server that no longer knows the task
    /// ends it.
    pub(crate) async fn poll_task(
        &self,
        resolved: Resolved,
        task: &TaskHandle,
        answers: Option<&str>,
    ) -> TaskPoll {
        // However often the session is looked at (a resync, an unrelated
        // event, a driver that looks every second), the server is asked
        // no more often than it said.
        if answers.is_none() && !self.poll_due(task) {
            return TaskPoll::NoNews;
        }
        let conn = match self.connection(resolved) {
            Ok(c) => c,
            Err(e) => return TaskPoll::Ended(ToolResult::error(e.to_string())),
        };
        if let Some(answers) = answers {
            if let Err(e) = update(&conn, task, answers).await {
                return self.failed_poll(task, e);
            }
        }
        let poll = match task_request(&conn, "tasks/get", task_params(task)).await {
            Ok(result) => {
                self.with_polls(task, |p| p.misses = 0);
                poll_of(&result)
            }
            Err(e) => self.failed_poll(task, e),
        };
        if matches!(poll, TaskPoll::Ended(_)) {
            self.forget(task);
        }
        poll
    }

    /// `tasks/cancel`; its failure is only logged (the call has ended).
    pub(crate) async fn cancel_task(&self, resolved: Resolved, task: &TaskHandle) {
        let outcome = match self.connection(resolved) {
            Ok(conn) => task_request(&conn, "tasks/cancel", task_params(task)).await,
            Err(e) => Err(e),
        };
        self.forget(task);
        match outcome {
            Ok(_) => tracing::info!(task = %task.id, "MCP task cancelled"),
            Err(e) => tracing::warn!(task = %task.id, error = %e, "cancelling the MCP task failed"),
        }
    }

    fn failed_poll(&self, task: &TaskHandle, e: McpError) -> TaskPoll {
        match e {
            McpError::Transport(why) => {
                let misses = self.with_polls(task, |p| {
                    p.misses += 1;
                    p.misses
                });
                if misses < MAX_UNREACHABLE_POLLS {
                    tracing::warn!(task = %task.id, misses, error = %why, "MCP task poll failed; polling again");
                    return TaskPoll::NoNews;
                }
                self.forget(task);
                TaskPoll::Ended(ToolResult::error(format!(
                    "the MCP server was unreachable for {MAX_UNREACHABLE_POLLS} polls of task {} in a row: {why}",
                    task.id
                )))
            }
            other => TaskPoll::Ended(ToolResult::error(format!(
                "the MCP server no longer follows task {}: {other}",
                task.id
            ))),
        }
    }

    /// True when `task` was not polled within its interval (less a little
    /// slack for timers); notes the poll.
    fn poll_due(&self, task: &TaskHandle) -> bool {
        let interval = std::time::Duration::from_millis(task.poll_ms.clamp(
            crate::core::session::MIN_POLL_MS,
            crate::core::session::MAX_POLL_MS,
        ));
        let slack = std::time::Duration::from_millis(250);
        let now = std::time::Instant::now();
        self.with_polls(task, |p| match p.last {
            Some(at) if now.duration_since(at) + slack < interval => false,
            _ => {
                p.last = Some(now);
                true
            }
        })
    }

    /// `change` applied to what is known of `task`'s polls (bounded).
    fn with_polls<T>(&self, task: &TaskHandle, change: impl FnOnce(&mut Polls) -> T) -> T {
        let mut all = self.tasks.lock().expect("mcp task polls");
        if all.len() >= MAX_FOLLOWED_TASKS && !all.contains_key(&task.id) {
            all.clear();
        }
        change(all.entry(task.id.clone()).or_default())
    }

    /// Drops what is known of an ended or cancelled task.
    fn forget(&self, task: &TaskHandle) {
        self.tasks.lock().expect("mcp task polls").remove(&task.id);
    }
}

async fn update(conn: &Connection, task: &TaskHandle, answers: &str) -> Result<(), McpError> {
    let responses: Value = serde_json::from_str(answers)
        .map_err(|e| McpError::Protocol(format!("the answers are not JSON: {e}")))?;
    let mut params = task_params(task);
    params.insert("inputResponses".into(), responses);
    task_request(conn, "tasks/update", params).await.map(|_| ())
}

fn task_params(task: &TaskHandle) -> Map<String, Value> {
    let mut params = Map::new();
    params.insert("taskId".into(), json!(task.id));
    params
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_task_answer_becomes_a_handle_and_a_bad_one_an_error() {
        let t = answer_of(
            &json!({"resultType": "task", "taskId": "t-1", "status": "working", "pollIntervalMs": 500}),
        );
        assert_eq!(
            t,
            ToolRun::Task(TaskHandle {
                id: "t-1".into(),
                poll_ms: 500
            })
        );
        let t = answer_of(&json!({"resultType": "task", "status": "working"}));
        assert!(matches!(t, ToolRun::Done(ref r) if r.is_error()), "{t:?}");
        let t = answer_of(&json!({"resultType": "task", "taskId": "x".repeat(300)}));
        assert!(matches!(t, ToolRun::Done(ref r) if r.is_error()), "{t:?}");
        let t = answer_of(&json!({"content": [{"type": "text", "text": "5"}]}));
        assert_eq!(t, ToolRun::Done(ToolResult::text("5")));
    }

    #[test]
    fn every_status_of_a_poll_is_read() {
        assert_eq!(poll_of(&json!({"status": "working"})), TaskPoll::Working);
        let done = poll_of(
            &json!({"status": "completed", "result": {"content": [{"type": "text", "text": "ok"}]}}),
        );
        assert_eq!(done, TaskPoll::Ended(ToolResult::text("ok")));
        let asks = poll_of(
            &json!({"status": "input_required", "inputRequests": {"k": {"method": "elicitation/create"}}}),
        );
        assert!(matches!(asks, TaskPoll::AsksForInput(ref a) if a.contains("elicitation")));
        let failed =
            poll_of(&json!({"status": "failed", "error": {"code": -1, "message": "disk full"}}));
        assert_eq!(
            failed,
            TaskPoll::Ended(ToolResult::error("the MCP task failed: disk full"))
        );
        let cancelled = poll_of(&json!({"status": "cancelled", "statusMessage": "by admin"}));
        assert!(
            matches!(cancelled, TaskPoll::Ended(ref r) if r.to_model_text().contains("by admin"))
        );
        let huge = poll_of(
            &json!({"status": "input_required", "inputRequests": {"k": "x".repeat(20_000)}}),
        );
        assert!(matches!(huge, TaskPoll::Ended(ref r) if r.is_error()));
        assert!(matches!(
            poll_of(&json!({"status": "odd"})),
            TaskPoll::Ended(_)
        ));
    }

    #[test]
    fn a_task_is_polled_no_faster_than_its_server_asked_nor_than_once_a_second() {
        let pool = McpPool::default();
        let slow = TaskHandle {
            id: "slow".into(),
            poll_ms: 5_000,
        };
        assert!(pool.poll_due(&slow), "the first poll is due");
        assert!(!pool.poll_due(&slow), "not again within 5 s");
        let fast = TaskHandle {
            id: "fast".into(),
            poll_ms: 10,
        };
        assert!(pool.poll_due(&fast));
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!pool.poll_due(&fast), "at most once a second");
        std::thread::sleep(std::time::Duration::from_millis(600));
        assert!(
            pool.poll_due(&fast),
            "due again after a second (less the slack)"
        );
    }

    #[test]
    fn what_is_known_of_tasks_is_bounded_and_goes_when_a_task_ends() {
        let pool = McpPool::default();
        let handle = |id: String| TaskHandle { id, poll_ms: 1_000 };
        for i in 0..MAX_FOLLOWED_TASKS + 10 {
            pool.poll_due(&handle(format!("t{i}")));
        }
        assert!(pool.tasks.lock().unwrap().len() <= MAX_FOLLOWED_TASKS);
        let lost = handle("lost".into());
        let miss = || pool.failed_poll(&lost, McpError::Transport("refused".into()));
        for _ in 1..MAX_UNREACHABLE_POLLS {
            assert_eq!(miss(), TaskPoll::NoNews, "a miss is no news");
        }
        assert!(matches!(miss(), TaskPoll::Ended(r) if r.is_error()));
        assert!(!pool.tasks.lock().unwrap().contains_key("lost"));
    }
}
