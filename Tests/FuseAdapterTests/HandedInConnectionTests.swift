import Glibc
import Testing
@testable import FuseAdapter

/// `/dev/fd/N` mount points: which strings name a handed-in connection, and the device numbers
/// a descriptor's stat gives.
@Suite struct HandedInConnectionTests {
    @Test(arguments: [
        ("/dev/fd/3", Int32(3)), ("/dev/fd/17", 17), ("/dev/fd/003", 3),
        ("/dev/fd/", nil), ("/dev/fd/3/", nil), ("/dev/fd/-3", nil), ("/dev/fd/+3", nil), ("/dev/fd/ 3", nil),
        ("/dev/fd/3x", nil), ("/dev/fd/1234567890", nil), ("dev/fd/3", nil), ("/proc/self/fd/3", nil), ("/mnt/x", nil),
    ] as [(String, Int32?)])
    func onlyDevFdFollowedByDigitsNamesADescriptor(mountpoint: String, fd: Int32?) {
        #expect(HandedInConnection.descriptor(in: mountpoint) == fd)
    }

    @Test func devFuseIsTheMiscDevice10_229() throws {
        var st = stat()
        try #require(stat("/dev/fuse", &st) == 0)
        #expect(HandedInConnection.deviceNumbers(st.st_rdev) == HandedInConnection.fuseDevice)
        try #require(stat("/dev/null", &st) == 0)
        #expect(HandedInConnection.deviceNumbers(st.st_rdev) == (1, 3))
    }

    @Test func aDescriptorThatIsNotOpenIsRefused() {
        let problem = HandedInConnection.problem(with: 987_654)
        #expect(problem?.contains("/dev/fd/987654 is not an open descriptor") == true)
    }
}
