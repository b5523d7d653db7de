/// The Filesystem's hooks for a mount from a manifest (ManifestNamespace): asked before the
/// caches and the bucket, they answer from the index or say that the bucket should.
extension Filesystem {
    /// The manifest's answer for `name` in `parentPath`: its kind, fresh forever with
    /// `manifest_refresh=never` (for `stat_ttl` with `list`); nil when the bucket answers.
    func manifestAnswer(_ path: String, parentPath: String, name: String) throws(FilesystemError) -> (Node.Kind, Double)? {
        guard let manifest else { return nil }
        switch try manifest.lookup(parentPath: parentPath, name: name) {
        case .found(let kind): return (kind, manifest.refresh == .never ? .infinity : now())
        case .absent: throw FilesystemError(.noEntry, "no \(path) in the manifest")
        case .bucket: return nil
        }
    }

    /// A handle on directory `path` read from the manifest; nil when its listing is read.
    func manifestDirectoryHandle(_ path: String, _ inode: UInt64) throws(FilesystemError) -> UInt64? {
        guard let manifest, let dir = try manifest.directory(path) else { return nil }
        return handles.add(.directory(path: path, inode: inode, source: .manifest(dir)))
    }
}
