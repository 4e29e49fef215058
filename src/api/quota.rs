//! A namespace's ResourceQuota refusing one of the operator's creates.

/// The API server's words when a namespace's ResourceQuota refused a
/// create for now: a 403 that passes once the namespace frees room (an
/// object ends and goes, a quota is raised) or once a new quota's usage is
/// counted ("status unknown"), unlike a 403 from RBAC or admission.
pub fn exceeded_quota(e: &kube::Error) -> Option<&str> {
    match e {
        kube::Error::Api(s)
            if s.code == 403
                && (s.message.contains("exceeded quota:")
                    || s.message.contains("status unknown for quota:")) =>
        {
            Some(&s.message)
        }
        _ => None,
    }
}
