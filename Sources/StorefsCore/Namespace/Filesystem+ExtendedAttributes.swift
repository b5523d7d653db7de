import StorageClient

/// Extended attributes: `user.storefs.download_url` and the object's metadata
/// (README, "Extended attributes").
extension Filesystem {
    static let xattrPrefix = "user.storefs."

    static let downloadURLAttribute = xattrPrefix + "download_url"

    /// The attribute names `uid` may see.
    public func extendedAttributeNames(_ inode: UInt64, requester uid: UInt32 = 0,
                                       network: Network = .allowed) throws(FilesystemError) -> [String] {
        var names = try xattrs(inode, withURL: false, network: network).map(\.0)
        if inode == Self.rootInode && (uid == 0 || uid == config.downloadURL.ownerUID) { names.append(Self.statsAttribute) }
        guard try isFile(inode) else { return names }
        if uid == 0 || uid == config.downloadURL.ownerUID { names.append(Self.cachedAttribute) }
        guard config.downloadURL.allows(uid) else { return names }
        return [Self.downloadURLAttribute] + names
    }

    public func extendedAttribute(_ inode: UInt64, name: String, requester uid: UInt32 = 0,
                                  network: Network = .allowed) throws(FilesystemError) -> [UInt8] {
        // `ls -l` asks each file for security.selinux and system.posix_acl_access. ENODATA
        // would have it ask again for every file (two round trips each); "not supported" is
        // remembered for the whole mount after the first (docs/architecture.md, "Metadata memory").
        guard name.hasPrefix("user.") else {
            throw FilesystemError(.attributeNamespaceUnsupported, "no \(name): storefs has user.* attributes only")
        }
        guard name.hasPrefix(Self.xattrPrefix) else { throw FilesystemError(.noAttribute, "no attribute \(name)") }
        if let value = try statisticsAttribute(inode, name: name, requester: uid) { return value }
        if name == Self.downloadURLAttribute, try isFile(inode) {
            switch config.downloadURL.access {
            case .off: throw FilesystemError(.noAttribute, "download_url is turned off (url_xattr=off)")
            case .owner where !config.downloadURL.allows(uid):
                throw FilesystemError(.permissionDenied, "download_url is readable by the mounting user only (url_xattr=owner)")
            default: break
            }
        }
        guard let value = try xattrs(inode, withURL: name == Self.downloadURLAttribute, network: network).first(where: { $0.0 == name })?.1 else {
            throw FilesystemError(.noAttribute, "no attribute \(name)")
        }
        return Array(value.utf8)
    }

    func isFile(_ inode: UInt64) throws(FilesystemError) -> Bool {
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        if case .file = node.kind { return true }
        return false
    }

    func xattrs(_ inode: UInt64, withURL: Bool, network: Network) throws(FilesystemError) -> [(String, String)] {
        _ = try attributes(of: inode, network: network)
        guard let node = table.withLock({ $0.nodes[inode] }) else {
            throw FilesystemError(.staleHandle, "unknown inode \(inode)")
        }
        let p = Self.xattrPrefix
        guard case .file(let record) = node.kind else {
            let name = listingPrefix(of: node.path)
            return [(p + "gs_uri", "gs://\(reference.bucket)/\(name)")]
        }
        let m = try fullObject(node.path, record, network: network)
        var out: [(String, String)] = [
            (p + "gs_uri", "gs://\(m.bucket)/\(m.name)"),
            (p + "generation", String(m.generation)),
        ]
        if let v = m.contentType { out.append((p + "content_type", v)) }
        if let v = m.md5Hash { out.append((p + "md5", v)) }
        if let v = m.crc32c { out.append((p + "crc32c", v)) }
        if let v = m.contentEncoding { out.append((p + "content_encoding", v)) }
        if let v = m.cacheControl { out.append((p + "cache_control", v)) }
        // Download tokens are capabilities: they appear only inside download_url.
        for key in m.custom.keys.sorted() where key != "firebaseStorageDownloadTokens" {
            out.append((p + "meta." + key, m.custom[key]!))
        }
        if withURL { out.append((Self.downloadURLAttribute, config.downloadURL.url(for: m))) }
        return out
    }

    /// The whole object resource of a file, for its extended attributes: kept briefly after a
    /// lookup fetched it, else fetched (one metadata GET). A resource of another generation
    /// (the object was replaced since this inode was made) is not this file's: ESTALE.
    func fullObject(_ path: String, _ record: FileRecord, network: Network) throws(FilesystemError) -> ObjectMetadata {
        let key = ByteName(path)
        if let m = fullMetadata.withLock({ $0.lookup(key, generation: record.generation, now: now(), ttl: config.statTTL) }) {
            return m
        }
        guard case .allowed(let isCancelled) = network else {
            throw FilesystemError(.wouldBlock, "attributes of \(path) need the bucket")
        }
        do throws(StorageError) {
            let m = try store.metadata(of: objectName(of: path), isCancelled: isCancelled)
            health.noteSuccess()
            guard m.generation == record.generation else {
                forgetPath(path)
                throw StorageError(.generationChanged, "\(path): the object was replaced (look it up again)")
            }
            fullMetadata.withLock { $0.remember(key, m, at: now()) }
            return m
        } catch {
            health.note(error)
            if error.code == .notFound { forgetPath(path) }
            throw FilesystemError(error)
        }
    }
}
