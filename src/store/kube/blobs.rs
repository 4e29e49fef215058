//! Spilled blobs: immutable, content-named ConfigMaps owned by the session, read back only from the session's own.

use super::*;

impl KubeStore {
    /// A blob of the session with `uid`: a ConfigMap it owns, so a marker
    /// cannot pull another session's data (or any other ConfigMap) in.
    pub(crate) async fn fetch_blob(&self, uid: &str, name: String) -> Result<Vec<u8>, String> {
        let key = blob_key(uid, &name);
        if let Some(b) = self.blobs.get(&key) {
            return Ok(b.to_vec());
        }
        let cm = self
            .configmaps
            .get_opt(&name)
            .await
            .map_err(|e| format!("reading ConfigMap {name}: {e}"))?
            .ok_or_else(|| format!("ConfigMap {name} holding spilled data is missing"))?;
        let owned = cm.owner_references().iter().any(|o| o.uid == uid);
        if uid.is_empty() || !owned {
            return Err(format!(
                "ConfigMap {name} is not this session's (it is not owned by session uid {uid}); \
                 spilled data is read only from the session's own blobs"
            ));
        }
        let data = cm
            .binary_data
            .and_then(|mut d| d.remove(BLOB_KEY))
            .ok_or_else(|| format!("ConfigMap {name} has no {BLOB_KEY}"))?
            .0;
        self.blobs.insert(key, Arc::new(data.clone()));
        Ok(data)
    }

    /// Creates the blobs not known to exist: immutable ConfigMaps owned by
    /// the session (garbage collected with it). Names derive from content,
    /// so an existing one already holds these bytes.
    pub(crate) async fn put_blobs(&self, owner: &SessionRef, blobs: Vec<Blob>) -> StoreResult<()> {
        for blob in blobs {
            let key = blob_key(&owner.uid, &blob.name);
            if self.blobs.contains(&key) {
                continue;
            }
            let cm = ConfigMap {
                metadata: ObjectMeta {
                    name: Some(blob.name.clone()),
                    namespace: Some(self.namespace.clone()),
                    labels: Some(BTreeMap::from([(
                        SESSION_LABEL.to_string(),
                        owner.id.0.clone(),
                    )])),
                    owner_references: Some(vec![owner_reference(owner)]),
                    ..ObjectMeta::default()
                },
                binary_data: Some(BTreeMap::from([(
                    BLOB_KEY.to_string(),
                    ByteString(blob.data.clone()),
                )])),
                immutable: Some(true),
                ..ConfigMap::default()
            };
            self.count_write();
            match self.configmaps.create(&PostParams::default(), &cm).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.is_already_exists() => {}
                Err(e) if exceeded_quota(&e).is_some() => {
                    return Err(quota_held(format!("the ConfigMap {}", blob.name), &e))
                }
                Err(kube::Error::Api(s)) if s.code == 403 => {
                    return Err(StoreError::Backend(format!(
                        "a result or conversation too large for its object must go into a ConfigMap, and this account may not create ConfigMaps in {}: {}",
                        self.namespace, s.message
                    )))
                }
                Err(e) => return Err(backend(e)),
            }
            self.blobs.insert(key, Arc::new(blob.data));
        }
        Ok(())
    }
}
