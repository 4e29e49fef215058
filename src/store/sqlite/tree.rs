//! Sub-agent trees in the embedded store: a child is created with its
//! link (parent, call, depth, root) in columns, and a tree is read by one
//! recursive query over `parent` (and a fork's `state.forkedFrom`).

use super::{five_columns, from_json, SqliteStore};
use crate::core::SessionId;
use crate::ports::{SessionRecord, StoreResult, TreeLink, TreeMember, Version};

type TreeRow = (String, Option<String>, Option<String>, i64, Option<String>);

impl SqliteStore {
    /// Creates the child session `record` under `link`; `SessionExists`
    /// when a session of that name is there already.
    pub async fn create_child_session(
        &self,
        record: SessionRecord,
        link: &TreeLink,
    ) -> StoreResult<Version> {
        self.create_linked(record, Some(link))
    }

    /// `root` and every session under it (its children, and its forks,
    /// which carry no link): the root first, then by depth and creation.
    /// Empty when there is no session `root`.
    pub async fn tree_members(&self, root: &SessionId) -> StoreResult<Vec<TreeMember>> {
        let rows: Vec<TreeRow> = self.with(|c| {
            five_columns(
                c,
                "WITH RECURSIVE tree(id) AS (
                    SELECT id FROM sessions WHERE id = ?1
                    UNION
                    SELECT s.id FROM sessions s JOIN tree
                      ON s.parent = tree.id
                      OR json_extract(s.record, '$.state.forkedFrom.session') = tree.id
                 )
                 SELECT s.record, s.parent, s.parent_call, s.depth, s.root
                 FROM sessions s JOIN tree ON s.id = tree.id
                 ORDER BY s.depth, s.created_at, s.id",
                [&root.0],
            )
        })?;
        rows.into_iter()
            .map(|(record, parent, call, depth, tree_root)| {
                let record: SessionRecord = from_json("session", &record)?;
                let link = parent.map(|parent| TreeLink {
                    parent: SessionId(parent),
                    call_id: call.unwrap_or_default(),
                    depth: depth as u32,
                    root: SessionId(tree_root.unwrap_or_default()),
                });
                Ok(TreeMember { record, link })
            })
            .collect()
    }
}
