//! Paging through the API server's `limit`/`continue`, with the filters
//! the API cannot apply done here, page by page.
//!
//! A Session's agent, phase and waitingFor, and a Continuation's wait,
//! are neither labels nor fields a CRD can be selected by without
//! `selectableFields` in its definition, so they are matched here on each
//! page the API returns. While such a filter drops rows, one console page
//! reads up to [`MAX_API_PAGES`] API pages to fill itself, never more: a
//! console page costs a bounded number of bounded reads.

use super::html::{api_message, field};
use super::Ui;
use kube::api::{Api, ListParams};
use kube::Resource;
use serde::de::DeserializeOwned;
use std::fmt::Debug;

/// Rows per page unless `limit` says otherwise.
pub const DEFAULT_LIMIT: u32 = 50;
/// The most rows a page asks the API for.
pub const MAX_LIMIT: u32 = 500;
/// The most API pages one console page reads while filtering here.
pub const MAX_API_PAGES: usize = 10;
/// A continue token is the API server's opaque base64 text; longer than
/// this it is not one.
const MAX_CONTINUE_BYTES: usize = 4096;

/// What page to read: its size and where the previous one stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageAsk {
    pub limit: u32,
    pub cont: Option<String>,
}

/// `limit` and `continue` from a page's query, checked.
pub fn page_ask(query: &[(String, String)]) -> Result<PageAsk, String> {
    let limit = match field(query, "limit").as_str() {
        "" => DEFAULT_LIMIT,
        text => match text.parse::<u32>() {
            Ok(n) if (1..=MAX_LIMIT).contains(&n) => n,
            _ => {
                return Err(format!(
                    "limit {text:?} is not a page size; give a number from 1 to {MAX_LIMIT}"
                ))
            }
        },
    };
    let cont = field(query, "continue");
    if cont.len() > MAX_CONTINUE_BYTES
        || !cont
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"+/=_-".contains(&b))
    {
        return Err(
            "this page link's continue token is damaged; start again from the first page".into(),
        );
    }
    Ok(PageAsk {
        limit,
        cont: Some(cont).filter(|c| !c.is_empty()),
    })
}

/// One console page of objects.
pub struct Scanned<K> {
    pub items: Vec<K>,
    /// Where the next page starts, when there is one.
    pub next: Option<String>,
    /// API pages read for this one.
    pub api_pages: usize,
    /// Objects read (before the filters here).
    pub read: usize,
    /// The namespace read, "" for all; the home namespace when listing all
    /// was refused.
    pub namespace: String,
}

impl Ui {
    /// Reads pages of `K` in `ns` ("" for every namespace, else the
    /// kubeconfig's namespace when that is refused), selected by `labels`
    /// on the server and by `keep` here, until `ask.limit` rows are kept,
    /// the list ends, or [`MAX_API_PAGES`] were read.
    pub async fn scan<K>(
        &self,
        ns: &str,
        labels: &str,
        ask: &PageAsk,
        keep: impl Fn(&K) -> bool,
    ) -> Result<Scanned<K>, String>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + DeserializeOwned
            + Debug,
    {
        let mut out = Scanned {
            items: Vec::new(),
            next: ask.cont.clone(),
            api_pages: 0,
            read: 0,
            namespace: ns.to_string(),
        };
        loop {
            let mut lp = ListParams::default().limit(ask.limit);
            if !labels.is_empty() {
                lp = lp.labels(labels);
            }
            if let Some(c) = &out.next {
                lp = lp.continue_token(c);
            }
            let list = self.list_one::<K>(&mut out.namespace, &lp).await?;
            out.api_pages += 1;
            out.read += list.items.len();
            out.next = list.metadata.continue_.filter(|c| !c.is_empty());
            out.items.extend(list.items.into_iter().filter(|k| keep(k)));
            if out.items.len() >= ask.limit as usize
                || out.next.is_none()
                || out.api_pages >= MAX_API_PAGES
            {
                return Ok(out);
            }
        }
    }

    /// One API list call; `ns` becomes the home namespace when listing
    /// every namespace is refused.
    async fn list_one<K>(
        &self,
        ns: &mut String,
        lp: &ListParams,
    ) -> Result<kube::api::ObjectList<K>, String>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>
            + Clone
            + DeserializeOwned
            + Debug,
    {
        let listed = if ns.is_empty() {
            match Api::<K>::all(self.client.clone()).list(lp).await {
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    *ns = self.home.clone();
                    Api::<K>::namespaced(self.client.clone(), ns).list(lp).await
                }
                other => other,
            }
        } else {
            Api::<K>::namespaced(self.client.clone(), ns).list(lp).await
        };
        listed.map_err(|e| match e {
            kube::Error::Api(s) if s.code == 410 => {
                "this listing expired on the API server (its continue token is too old); start again from the first page".to_string()
            }
            e => api_message(&e),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::q;
    use super::*;

    #[test]
    fn a_page_defaults_to_fifty_rows_from_the_start() {
        assert_eq!(
            page_ask(&[]).unwrap(),
            PageAsk {
                limit: DEFAULT_LIMIT,
                cont: None
            }
        );
    }

    #[test]
    fn the_api_servers_continue_token_passes_through() {
        let token = "eyJ2IjoibWV0YS5rOHMuaW8vdjEiLCJydiI6MTIzLCJzdGFydCI6InMwMDA0OVx1MDAwMCJ9";
        let ask = page_ask(&q(&[("limit", "100"), ("continue", token)])).unwrap();
        assert_eq!(ask.limit, 100);
        assert_eq!(ask.cont.as_deref(), Some(token));
    }

    #[test]
    fn a_page_size_out_of_bounds_is_refused_with_the_bounds() {
        for bad in ["0", "501", "-1", "many"] {
            let err = page_ask(&q(&[("limit", bad)])).unwrap_err();
            assert!(err.contains("from 1 to 500"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_damaged_continue_token_is_refused() {
        for bad in ["a b", "<script>", "x\"y", &"A".repeat(5000)] {
            let err = page_ask(&q(&[("continue", bad)])).unwrap_err();
            assert!(err.contains("first page"), "{err}");
        }
    }
}
