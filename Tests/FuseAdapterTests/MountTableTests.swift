import Testing
@testable import FuseAdapter

/// The one parser of `/proc/self/mountinfo` (the daemon's read-ahead and its mount-point checks).
@Suite struct MountTableTests {
    static let text = """
        22 1 0:21 / /proc rw,nosuid - proc proc rw
        98 22 0:45 / /mnt/a\\040b\\011c\\134d rw,nosuid shared:7 master:1 - fuse.storefs gs://bkt/p\\040q ro,user_id=0
        99 22 0:46 / /mnt/plain rw - fuse.storefs bkt ro
        100 22 0:47 / /mnt/plain rw - tmpfs tmpfs rw
        garbage line
        101 22 0:48 / /mnt/nl\\012x rw - ext4 /dev/vdb rw
        """

    @Test func escapedMountPointsAreFoundByTheirBytes() throws {
        let table = MountTable(parsing: Self.text)
        let m = try #require(table.mount(at: "/mnt/a b\tc\\d"))
        #expect(m == .init(device: "0:45", mountPoint: "/mnt/a b\tc\\d", type: "fuse.storefs", source: "gs://bkt/p q"))
        #expect(table.mount(at: "/mnt/nl\nx")?.type == "ext4")
        #expect(table.mount(at: "/mnt/a\\040b\\011c\\134d") == nil, "the escaped form is not a path")
    }

    @Test func theMountOnTopIsTheOneReported() {
        #expect(MountTable(parsing: Self.text).mount(at: "/mnt/plain")?.type == "tmpfs")
    }

    @Test func linesThatAreNotMountsAreSkipped() {
        #expect(MountTable(parsing: Self.text).mounts.count == 5)
        #expect(MountTable(parsing: "").mounts.isEmpty)
        #expect(MountTable(parsing: "1 2 3 4 5 6 7").mounts.isEmpty, "no separator")
    }
}
